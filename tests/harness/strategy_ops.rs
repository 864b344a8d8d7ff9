//! The ops harness for any strategy: fuzzer bytes decoded into a setup and operations, applied to the
//! strategy's model, every property checked after each ([`crate::ops_common::run_model`]). Each strategy
//! says how its inputs decode and what its model checks ([`OpsHarness`]); the fuzz targets `expandable_ops`
//! and `split_ops` are [`fuzz`] with their strategy, and `tests/fuzz_corpus.rs` runs the same code.

use crate::ops_common::{Failure, Model, OnSim, Summary, run_model};
use std::fmt;

/// A strategy on the simulated device as the ops harness drives it.
pub trait OpsHarness: OnSim {
    /// The device and configuration an input sets up.
    type Setup: fmt::Debug;
    /// The strategy with a model of its live allocations, which applies operations and checks properties.
    type Model: Model;
    /// Decodes fuzzer bytes: the setup, then the operations.
    fn decode(data: &[u8]) -> (Self::Setup, Vec<Action<Self>>);
    /// A fresh strategy and model for `setup`.
    fn model(setup: &Self::Setup) -> Self::Model;
}

/// The operations of strategy `S`'s harness.
pub type Action<S> = <<S as OpsHarness>::Model as Model>::Action;

/// Decodes `data`, applies every operation to `S`'s model and checks the properties; returns the model
/// after its final cleanup, or the first property that broke.
pub fn run<S: OpsHarness>(data: &[u8]) -> Result<S::Model, Failure<S::Setup, Action<S>>> {
    let (setup, actions) = S::decode(data);
    let mut model = S::model(&setup);
    run_model(&mut model, setup, actions)?;
    Ok(model)
}

/// [`run`], and what the input exercised.
#[allow(dead_code)] // tests/fuzz_corpus.rs's; the fuzz targets run `fuzz`.
pub fn summary<S: OpsHarness>(data: &[u8]) -> Result<Summary, Failure<S::Setup, Action<S>>> {
    let actions = S::decode(data).1.len();
    let model = run::<S>(data)?;
    Ok(Summary {
        actions,
        ..model.summary()
    })
}

/// The fuzz target of strategy `S`: panics with the setup and operations when a property breaks.
#[allow(dead_code)] // The fuzz targets'; tests/fuzz_corpus.rs calls `summary`.
pub fn fuzz<S: OpsHarness>(data: &[u8])
where
    Action<S>: fmt::Debug,
{
    if let Err(failure) = run::<S>(data) {
        panic!("{failure}");
    }
}
