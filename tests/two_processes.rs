//! Two processes take turns on one GPU (issue 44), on the simulated device: an inference engine (weights
//! kept, a KV cache and a CUDA graph's memory discarded) and a trainer (parameters and optimizer state
//! kept, activations allocated and freed each step) each need most of the device, so each sleeps what the
//! other needs before the other wakes. Two simulators made with `SimDriver::another_process` share one
//! device's memory, as two processes share a GPU.
//!
//! Checked over several cycles: every kept byte is back after each wake, nothing of the device is lost
//! (after both sleep, the device is free but for the graph's memory nobody may hand out), a wake while the
//! other process is awake runs out of memory (so the test shows the turns are needed), and a cycle's
//! driver time under the H100 latency model, an estimate, is printed (`cargo test --test two_processes --
//! --nocapture`): the second cycle on pins nothing.

use cuvmm::driver::Driver as _;
use cuvmm::driver::sim::{LatencyModel, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Config, Strategy as _, StreamId};

const PAGE: u64 = 2 << 20;
/// A device of 256 MiB.
const PAGES: u64 = 128;

/// Fills `len` bytes at `addr` with `value` (a `cuMemsetD8`: the simulator keeps it as a range).
fn fill(a: &mut Expandable<SimDriver>, addr: u64, len: u64, value: u8) {
    a.driver_mut().memset_d8(addr, len, value).unwrap();
}

/// Whether every byte of `addr .. addr + len` is `value`.
fn holds(a: &Expandable<SimDriver>, addr: u64, len: u64, value: u8) -> bool {
    let bytes = a.driver().read(addr, len as usize).unwrap();
    bytes.iter().all(|&b| b == value)
}

fn config() -> Config {
    Config::default().with_sleep_copy(16 << 20)
}

/// The inference engine: weights (kept at its sleep), a KV cache (discarded).
struct Inference {
    a: Expandable<SimDriver>,
    weights: u64,
    kv: u64,
}

/// The trainer: parameters and optimizer state (kept at its sleep); activations each step.
struct Training {
    a: Expandable<SimDriver>,
    params: u64,
    optimizer: u64,
}

// Inference awake holds 180 MiB, training 150 MiB and 50 MiB of activations in a step: either fits the
// device alone, both do not.
const WEIGHTS: u64 = 40 * PAGE;
const KV: u64 = 50 * PAGE;
const PARAMS: u64 = 50 * PAGE;
const OPTIMIZER: u64 = 25 * PAGE;
const ACTIVATIONS: u64 = 25 * PAGE;

impl Inference {
    fn new(sim: SimDriver) -> Self {
        let mut a = Expandable::new(sim, config()).unwrap();
        let s = StreamId(1);
        let weights = a.alloc_tagged(WEIGHTS, s, "weights").unwrap();
        let kv = a.alloc_tagged(KV, s, "kv_cache").unwrap();
        fill(&mut a, weights, WEIGHTS, 1);
        Self { a, weights, kv }
    }

    /// Serving: the KV cache filled for this turn, the weights read.
    fn serve(&mut self, turn: u64) {
        assert!(holds(&self.a, self.weights, WEIGHTS, 1), "turn {turn}");
        fill(&mut self.a, self.kv, KV, 100 + turn as u8);
    }

    fn sleep(&mut self) {
        self.a.sleep("weights", true).unwrap();
        self.a.sleep("kv_cache", false).unwrap();
    }

    fn wake(&mut self) -> Result<(), cuvmm::Error> {
        self.a.wake("weights")?;
        self.a.wake("kv_cache")
    }
}

impl Training {
    fn new(sim: SimDriver) -> Self {
        let mut a = Expandable::new(sim, config()).unwrap();
        let s = StreamId(1);
        let params = a.alloc_tagged(PARAMS, s, "train").unwrap();
        let optimizer = a.alloc_tagged(OPTIMIZER, s, "train").unwrap();
        fill(&mut a, params, PARAMS, 2);
        fill(&mut a, optimizer, OPTIMIZER, 3);
        Self {
            a,
            params,
            optimizer,
        }
    }

    /// A training step: activations allocated and freed (untagged), the state updated.
    fn step(&mut self, turn: u64) {
        assert!(
            holds(&self.a, self.params, PARAMS, 2 + turn as u8),
            "turn {turn}"
        );
        assert!(holds(&self.a, self.optimizer, OPTIMIZER, 3), "turn {turn}");
        let activations = self.a.alloc(ACTIVATIONS, StreamId(1)).unwrap();
        fill(&mut self.a, activations, ACTIVATIONS, 7);
        self.a.free(activations).unwrap();
        fill(&mut self.a, self.params, PARAMS, 3 + turn as u8);
    }

    fn sleep(&mut self) {
        self.a.sleep("train", true).unwrap();
        // Its activations' cache goes back too: the other process needs the memory.
        self.a.empty_cache().unwrap();
    }

    fn wake(&mut self) -> Result<(), cuvmm::Error> {
        self.a.wake("train")
    }
}

/// Driver time of both processes so far (the simulator's latency model: an estimate).
fn train_and_infer_ns(train: &Training, infer: Option<&Inference>) -> u64 {
    let ns = |a: &Expandable<SimDriver>| a.driver().counters().time_ns;
    ns(&train.a) + infer.map_or(0, |i| ns(&i.a))
}

#[test]
fn an_inference_and_a_training_process_take_turns_on_one_device() {
    let device = SimConfig::default()
        .with_capacity(PAGES * PAGE)
        .with_backing_store(true)
        .with_latency(LatencyModel::h100());
    let mut first = SimDriver::new(device);
    let second = first.another_process();
    // The trainer starts; the inference engine is made in the first cycle, woken in the others.
    let mut train = Training::new(first);
    let mut infer: Option<Inference> = None;
    let mut second = Some(second);
    let mut cycles = Vec::new();
    for turn in 0..4 {
        let began = train_and_infer_ns(&train, infer.as_ref());
        train.step(turn);
        train.sleep();
        match &mut infer {
            None => infer = Some(Inference::new(second.take().unwrap())),
            Some(infer) => infer.wake().unwrap(),
        }
        let engine = infer.as_mut().unwrap();
        let check = train_and_infer_ns(&train, Some(engine));
        assert!(
            train.wake().unwrap_err().is_out_of_memory(),
            "turn {turn}: both awake do not fit"
        );
        // The wake that ran out of memory mapped part of the tag: a sleep gives it back. (Not timed.)
        train.sleep();
        let checked = train_and_infer_ns(&train, Some(engine)) - check;
        engine.serve(turn);
        engine.sleep();
        assert!(
            engine.a.driver().free_bytes() >= (PAGES - 1) * PAGE,
            "both asleep: the device is free"
        );
        train.wake().unwrap();
        engine.a.check_invariants().unwrap();
        train.a.check_invariants().unwrap();
        cycles.push(train_and_infer_ns(&train, infer.as_ref()) - began - checked);
    }
    let mut infer = infer.unwrap();
    for (turn, ns) in cycles.iter().enumerate() {
        println!(
            "cycle {turn}: {:.1} ms of driver time (H100 model, an estimate)",
            *ns as f64 / 1e6
        );
    }
    assert!(
        cycles[1] < cycles[0],
        "later cycles pin nothing: {cycles:?}"
    );
    assert!(
        cycles[2] <= cycles[1] + cycles[1] / 100,
        "cycles after the first cost the same: {cycles:?}"
    );
    train.sleep();
    infer.wake().unwrap();
    assert!(holds(&infer.a, infer.weights, WEIGHTS, 1));
    let (weights, kv) = (infer.weights, infer.kv);
    infer.a.free(weights).unwrap();
    infer.a.free(kv).unwrap();
}
