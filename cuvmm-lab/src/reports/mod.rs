//! Presenting results: [`table`] renders replay results as an aligned table or JSON; [`sample`] records
//! allocated and reserved bytes over a replay and [`plot`] draws them as an SVG.

pub mod plot;
pub mod sample;
pub mod table;
