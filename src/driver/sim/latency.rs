//! The latency model: how long each simulated driver call would have taken on a real device.
//!
//! A call costs a fixed amount plus an amount per 2 MiB unit it covers ([`LatencyModel::cost_ns`]); for
//! `set_access` and `unmap` the fixed amount is paid once per *mapping* the call covers, as measured on an
//! H100: one call over k single-page mappings costs what k calls do. Three devices' figures are known:
//!
//! - [`LatencyModel::h100`] and [`LatencyModel::h200`]: **measured** with `cuvmm driver-bench --backend
//!   cuda` on an H100 and an H200 (driver 580, 2026-11-24, docs/gpu-results.md) at 2 MiB to 1 GiB and
//!   fitted by `tools/gpu/fit_latency.py`.
//! - [`LatencyModel::a100`]: one published figure per operation on a 2 MiB range, which cannot tell the
//!   fixed part from the per-byte part, so estimates are given under both extreme calibrations
//!   ([`Calibration`]): all of it per call, or all of it per 2 MiB unit (what the simulator's clock charges).
//!
//! The simulator's clock uses the model of its [`SimConfig`](super::SimConfig) (A100 by default, `cuvmm
//! compare --latency-model h100` or `h200` for the measured ones); a replay's report gives its calls' estimate under every
//! model (`cuvmm_lab::replay::ByModel`).

use crate::base::size::MIB;
use crate::driver::{DriverCounters, Op};

/// The size one unit of [`LatencyModel::per_unit_ns`] stands for: one 2 MiB page.
pub const LATENCY_UNIT_BYTES: u64 = 2 * MIB;

/// Driver latency per operation, in nanoseconds: a fixed part per call (per mapping covered, for
/// `set_access` and `unmap`) and a part per 2 MiB unit covered. Indexed like [`Op::ALL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencyModel {
    /// The device the figures are for (`a100`, `h100`, `h200`, or `zero`).
    pub name: &'static str,
    /// Nanoseconds per call of each operation (per mapping covered, for `set_access` and `unmap`).
    pub fixed_ns: [u64; Op::ALL.len()],
    /// Nanoseconds per 2 MiB unit a call covers, at least one unit per call of an operation that carries
    /// a size.
    pub per_unit_ns: [u64; Op::ALL.len()],
}

/// The names [`LatencyModel::named`] knows.
pub const LATENCY_MODELS: [&str; 3] = ["a100", "h100", "h200"];

impl LatencyModel {
    /// Published A100 figures for 2 MiB pages: create 193 us, map 1.5 us, set_access 36 us, unmap 26 us;
    /// release as unmap. All of each figure is charged per 2 MiB unit (the per-byte calibration); the
    /// per-call calibration is [`Calibration::PerCall`].
    ///
    /// Only those four are measurements. Every other figure is an **assumption** chosen to be plausible,
    /// not measured:
    ///
    /// | op | ns | how it was chosen |
    /// |---|---|---|
    /// | create | 193 000 | measured (A100, 2 MiB) |
    /// | map | 1 500 | measured (A100, 2 MiB) |
    /// | set_access | 36 000 | measured (A100, 2 MiB) |
    /// | unmap | 26 000 | measured (A100, 2 MiB) |
    /// | release | 26 000 | assumed equal to unmap |
    /// | malloc | 230 500 | assumed create + map + set_access |
    /// | free | 52 000 | assumed unmap + release |
    /// | reserve, free_reservation | 5 000 | assumed (VA bookkeeping only) |
    /// | mem_info, record_event, query_event, destroy_event | 1 000 | assumed (no device work) |
    /// | synchronize | 5 000 | assumed (round trip on an idle stream; the simulator runs no kernels) |
    /// | memset | 10 000 | assumed (a kernel launch and a wait; 2 MiB at ~1.5 TB/s is ~1.4 us) |
    /// | copy_to_host, copy_from_host | 105 000 | assumed: 2 MiB at 20 GB/s, a pinned copy over PCIe 4 x16 |
    /// | host_alloc | 500 000 | assumed: 2 MiB pinned at 4 GB/s (`cuMemHostAlloc` faults in and locks pages) |
    /// | capture_info | 100 | assumed (a host-side query) |
    /// | export, import | 10 000 | assumed (a file descriptor made or opened by the kernel driver) |
    pub fn a100() -> Self {
        Self::from_parts("a100", |op| {
            let figure = match op {
                Op::Create => 193_000,
                Op::Map => 1_500,
                Op::SetAccess => 36_000,
                Op::Unmap | Op::Release => 26_000,
                Op::Malloc => 193_000 + 1_500 + 36_000,
                Op::Free => 26_000 + 26_000,
                Op::Reserve | Op::FreeReservation | Op::Synchronize => 5_000,
                Op::MemInfo | Op::RecordEvent | Op::QueryEvent | Op::DestroyEvent => 1_000,
                Op::Memset => 10_000,
                Op::CopyToHost | Op::CopyFromHost => 105_000,
                Op::HostAlloc => 500_000,
                Op::CaptureInfo => 100,
                Op::Export | Op::Import => 10_000,
            };
            (0, figure)
        })
    }

    /// An NVIDIA H100 80GB HBM3 (driver 580.159.04), measured 2026-11-24 with `cuvmm driver-bench
    /// --backend cuda` (medians of 20 at 2, 20, 64, 512 MiB and 1 GiB; docs/gpu-results.md) and fitted
    /// with `python3 tools/gpu/fit_latency.py driver-bench.json` (least squares on relative error).
    ///
    /// | op | fixed ns | ns per 2 MiB | fit, model minus measured at 2 MiB .. 1 GiB |
    /// |---|---|---|---|
    /// | create | 13 612 | 46 | -8%, 0%, +2%, +18%, -81% (1 GiB takes 196 us: a step the line leaves out) |
    /// | map | 1 130 | 1 | within 9% |
    /// | set_access | 36 189 per mapping | 104 | +23% .. -20% |
    /// | unmap | 23 184 per mapping | 30 | +18% .. -14% |
    /// | release | 14 864 | 1 347 | +10% .. -21% |
    /// | malloc (`cuMemAlloc`) | 55 057 | 156 | +10% .. -39% |
    /// | free (`cuMemFree`) | 42 688 | 1 255 | within 8% |
    /// | synchronize (idle stream) | 697 | 0 | measured |
    /// | record_event | 1 288 | 0 | measured (with the event's creation) |
    /// | query_event | 462 | 0 | measured |
    /// | destroy_event | 462 | 0 | assumed as query_event |
    /// | reserve, free_reservation | 3 000 | 0 | reserve measured 2-6 us (160 GB to 1.28 TB); free assumed |
    /// | mem_info | 1 000 | 0 | assumed |
    /// | memset | 10 000 | 0 | assumed, as for the A100 |
    /// | copy_to_host, copy_from_host | 10 000 | 84 000 | assumed: a pinned copy at 25 GB/s (PCIe 5 x16 as users report it) |
    /// | host_alloc | 20 000 | 500 000 | assumed, as for the A100 |
    /// | capture_info | 100 | 0 | assumed (a host-side query) |
    /// | export, import | 10 000 | 0 | assumed, as for the A100 |
    pub fn h100() -> Self {
        Self::from_parts("h100", |op| match op {
            Op::Create => (13_612, 46),
            Op::Map => (1_130, 1),
            Op::SetAccess => (36_189, 104),
            Op::Unmap => (23_184, 30),
            Op::Release => (14_864, 1_347),
            Op::Malloc => (55_057, 156),
            Op::Free => (42_688, 1_255),
            Op::Synchronize => (697, 0),
            Op::RecordEvent => (1_288, 0),
            Op::QueryEvent | Op::DestroyEvent => (462, 0),
            Op::Reserve | Op::FreeReservation => (3_000, 0),
            Op::MemInfo => (1_000, 0),
            Op::Memset => (10_000, 0),
            Op::CopyToHost | Op::CopyFromHost => (10_000, 84_000),
            Op::HostAlloc => (20_000, 500_000),
            Op::CaptureInfo => (100, 0),
            Op::Export | Op::Import => (10_000, 0),
        })
    }

    /// An NVIDIA H200 (141 GB, driver 580.159.04), measured and fitted as [`h100`](Self::h100) was, the
    /// same day (docs/gpu-results/driver-bench-h200.json). About half the H100 machine's figures:
    ///
    /// | op | fixed ns | ns per 2 MiB | fit, model minus measured at 2 MiB .. 1 GiB |
    /// |---|---|---|---|
    /// | create | 6 476 | 15 | within 3% |
    /// | map | 554 | 0 | within 6% |
    /// | set_access | 22 380 per mapping | 68 | +27% .. -25% |
    /// | unmap | 15 719 per mapping | 24 | +22% .. -18% |
    /// | release | 8 807 | 494 | +14% .. -30% |
    /// | malloc (`cuMemAlloc`) | 28 875 | 85 | within 8% |
    /// | free (`cuMemFree`) | 24 947 | 512 | within 9% |
    /// | synchronize (idle stream) | 300 | 0 | measured |
    /// | record_event | 496 | 0 | measured (with the event's creation) |
    /// | query_event, destroy_event | 192 | 0 | query measured; destroy assumed as query |
    /// | reserve, free_reservation | 3 000 | 0 | reserve measured 2-14 us (160 GB to 1.28 TB); free assumed |
    /// | mem_info | 1 000 | 0 | assumed |
    /// | memset | 10 000 | 0 | assumed, as for the A100 |
    /// | copy_to_host, copy_from_host | 10 000 | 84 000 | assumed, as for the H100 |
    /// | host_alloc | 20 000 | 500 000 | assumed, as for the A100 |
    /// | capture_info | 100 | 0 | assumed (a host-side query) |
    /// | export, import | 10 000 | 0 | assumed, as for the A100 |
    pub fn h200() -> Self {
        Self::from_parts("h200", |op| match op {
            Op::Create => (6_476, 15),
            Op::Map => (554, 0),
            Op::SetAccess => (22_380, 68),
            Op::Unmap => (15_719, 24),
            Op::Release => (8_807, 494),
            Op::Malloc => (28_875, 85),
            Op::Free => (24_947, 512),
            Op::Synchronize => (300, 0),
            Op::RecordEvent => (496, 0),
            Op::QueryEvent | Op::DestroyEvent => (192, 0),
            Op::Reserve | Op::FreeReservation => (3_000, 0),
            Op::MemInfo => (1_000, 0),
            Op::Memset => (10_000, 0),
            Op::CopyToHost | Op::CopyFromHost => (10_000, 84_000),
            Op::HostAlloc => (20_000, 500_000),
            Op::CaptureInfo => (100, 0),
            Op::Export | Op::Import => (10_000, 0),
        })
    }

    /// A model named `name` whose operation `op` costs `parts(op)`: (fixed ns, ns per 2 MiB unit).
    fn from_parts(name: &'static str, parts: impl Fn(Op) -> (u64, u64)) -> Self {
        let mut model = Self::zero();
        model.name = name;
        for op in Op::ALL {
            (model.fixed_ns[op as usize], model.per_unit_ns[op as usize]) = parts(op);
        }
        model
    }

    /// The model called `name` ([`LATENCY_MODELS`]), or `None`.
    pub fn named(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "a100" => Some(Self::a100()),
            "h100" => Some(Self::h100()),
            "h200" => Some(Self::h200()),
            _ => None,
        }
    }

    /// A model in which every call is free: counters still count calls, but the time stays 0.
    pub fn zero() -> Self {
        Self {
            name: "zero",
            fixed_ns: [0; Op::ALL.len()],
            per_unit_ns: [0; Op::ALL.len()],
        }
    }

    /// Nanoseconds of one call of `op` on one 2 MiB page.
    #[inline]
    pub fn per_page(&self, op: Op) -> u64 {
        self.fixed_ns[op as usize].saturating_add(self.per_unit_ns[op as usize])
    }

    /// The fixed part of `op`: per call, or per mapping covered for `set_access` and `unmap`.
    #[inline]
    pub fn fixed(&self, op: Op) -> u64 {
        self.fixed_ns[op as usize]
    }

    /// Estimated nanoseconds for one call of `op` covering `bytes` bytes (and one mapping).
    ///
    /// Operations that carry a size (create, release, map, set_access, unmap, malloc, free, memset,
    /// copy_to_host, copy_from_host, host_alloc; for release and free the size of the handle or allocation) cost `fixed_ns[op] +
    /// per_unit_ns[op] * max(1, ceil(bytes / 2 MiB))`: under the A100 model (no fixed part) a 4 MiB map costs
    /// two units, a 64 KiB one costs one unit whatever the device's granularity. Every other operation costs
    /// `fixed_ns[op] + per_unit_ns[op]` flat. Saturates instead of overflowing.
    pub fn cost_ns(&self, op: Op, bytes: u64) -> u64 {
        self.charge(op, bytes).0
    }

    /// [`cost_ns`](Self::cost_ns) and [`units`](Self::units) of one call, together.
    #[inline(always)]
    pub(super) fn charge(&self, op: Op, bytes: u64) -> (u64, u64) {
        let units = Self::units(op, bytes);
        let cost = self.per_unit_ns[op as usize]
            .saturating_mul(units)
            .saturating_add(self.fixed_ns[op as usize]);
        (cost, units)
    }
}

/// How a [`LatencyModel`]'s figures are applied to counted calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Calibration {
    /// Every call as if it covered one 2 MiB page and one mapping: a 20 MiB create costs what a 2 MiB one
    /// does. For the A100 figures, all of each figure per call.
    PerCall,
    /// The model as it stands: the fixed part per call (per mapping for set_access and unmap), the rest
    /// per 2 MiB unit covered. For the A100 figures, all of each per unit (the simulator's clock).
    PerByte,
}

impl Calibration {
    /// Both, per call first.
    pub const BOTH: [Calibration; 2] = [Calibration::PerCall, Calibration::PerByte];
}

/// Where the figures of the latency models come from, for reports.
pub const LATENCY_SOURCES: &str = "A100, 2 MiB: create 193 us, map 1.5 us, set_access 36 us, unmap 26 us \
     (published measurements quoted in docs/DESIGN.md); every other figure is an assumption. per_call: each \
     figure is a fixed cost per call; per_byte: each is a cost per 2 MiB unit covered (the simulator's \
     clock). h100, h200: measured on an H100 and an H200 (driver 580) with cuvmm driver-bench and fitted as a \
     fixed cost per call (per mapping for set_access and unmap) plus a cost per 2 MiB (docs/gpu-results.md). Covers the \
     calls counted in driver_calls; event calls and synchronizations are counted apart.";

impl LatencyModel {
    /// The 2 MiB units one call of `op` covering `bytes` is charged for: `max(1, ceil(bytes / 2 MiB))` for
    /// operations that carry a size, 1 for the others.
    #[inline]
    pub fn units(op: Op, bytes: u64) -> u64 {
        if carries_size(op) {
            bytes.div_ceil(LATENCY_UNIT_BYTES).max(1)
        } else {
            1
        }
    }

    /// Estimated microseconds of the calls of `ops` in `counters` under `calibration` (which needs the
    /// units and mappings a simulator records).
    pub fn estimate_us(
        &self,
        counters: &DriverCounters,
        ops: &[Op],
        calibration: Calibration,
    ) -> f64 {
        let ns: u128 = ops
            .iter()
            .map(|&op| {
                let (calls, i) = (counters.get(op) as u128, op as usize);
                let (fixed, per_unit) = (self.fixed_ns[i] as u128, self.per_unit_ns[i] as u128);
                match calibration {
                    Calibration::PerCall => calls * (fixed + per_unit),
                    Calibration::PerByte => {
                        let units = if carries_size(op) {
                            counters.units[i] as u128
                        } else {
                            calls
                        };
                        (calls + counters.extra_mappings[i] as u128) * fixed + units * per_unit
                    }
                }
            })
            .sum();
        ns as f64 / 1_000.0
    }
}

/// Modelled latencies shorter than this are waited out by spinning ([`wait_out`]).
const SPIN_BELOW_NS: u64 = 20_000;

/// Waits `ns` nanoseconds: spinning below [`SPIN_BELOW_NS`], where the operating system's sleep would
/// overshoot many times over (a 100 ns capture query slept for tens of microseconds), sleeping above.
pub(super) fn wait_out(ns: u64) {
    if ns == 0 {
        return;
    }
    let wait = std::time::Duration::from_nanos(ns);
    if ns < SPIN_BELOW_NS {
        let start = std::time::Instant::now();
        while start.elapsed() < wait {
            std::hint::spin_loop();
        }
    } else {
        std::thread::sleep(wait);
    }
}

impl Default for LatencyModel {
    /// [`LatencyModel::a100`].
    fn default() -> Self {
        Self::a100()
    }
}

/// Whether the cost of `op` scales with the bytes it covers.
#[inline]
fn carries_size(op: Op) -> bool {
    matches!(
        op,
        Op::Create
            | Op::Release
            | Op::Map
            | Op::SetAccess
            | Op::Unmap
            | Op::Malloc
            | Op::Free
            | Op::Memset
            | Op::CopyToHost
            | Op::CopyFromHost
            | Op::HostAlloc
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calibrations_differ_only_on_sized_calls_larger_than_a_unit() {
        let m = LatencyModel::a100();
        let mut c = DriverCounters::default();
        c.record(Op::Create, 0);
        c.record_units(Op::Create, 1, LatencyModel::units(Op::Create, 20 * MIB));
        c.record(Op::Synchronize, 0);
        c.record_units(
            Op::Synchronize,
            1,
            LatencyModel::units(Op::Synchronize, 20 * MIB),
        );
        let ops = [Op::Create, Op::Synchronize];
        assert_eq!(m.estimate_us(&c, &ops, Calibration::PerCall), 198.0);
        assert_eq!(m.estimate_us(&c, &ops, Calibration::PerByte), 1_935.0);
        assert_eq!(
            m.estimate_us(&c, &[Op::Create], Calibration::PerCall),
            193.0
        );
    }

    #[test]
    fn sized_ops_scale_by_2mib_units_and_others_are_flat() {
        let m = LatencyModel::a100();
        assert_eq!(m.cost_ns(Op::Create, 2 * MIB), 193_000);
        assert_eq!(m.cost_ns(Op::Map, 4 * MIB), 3_000);
        assert_eq!(m.cost_ns(Op::Map, 4 * MIB + 1), 4_500);
        assert_eq!(m.cost_ns(Op::Unmap, 64 * 1024), 26_000);
        assert_eq!(m.cost_ns(Op::Release, 0), 26_000);
        assert_eq!(m.cost_ns(Op::Reserve, 1 << 40), 5_000);
        assert_eq!(m.cost_ns(Op::Malloc, 2 * MIB), 230_500);
        assert_eq!(m.cost_ns(Op::Free, 2 * MIB), 52_000);
        assert_eq!(m.cost_ns(Op::Create, u64::MAX), 193_000 << 43);
        let mut huge = LatencyModel::zero();
        huge.per_unit_ns[Op::Map as usize] = u64::MAX / 2 + 1;
        assert_eq!(huge.cost_ns(Op::Map, 4 * MIB), u64::MAX);
    }

    #[test]
    fn the_h100_model_has_a_fixed_part_and_charges_set_access_per_mapping() {
        let m = LatencyModel::h100();
        // A fixed part and a per-byte part: a 20 MiB create costs little more than a 2 MiB one.
        assert_eq!(m.cost_ns(Op::Create, 2 * MIB), 13_612 + 46);
        assert_eq!(m.cost_ns(Op::Create, 20 * MIB), 13_612 + 460);
        // One set_access over ten single-page mappings costs ten fixed parts under the model as it stands.
        let mut c = DriverCounters::default();
        c.record(Op::SetAccess, 0);
        c.record_units(Op::SetAccess, 1, 10);
        c.record_extra_mappings(Op::SetAccess, 9);
        let ops = [Op::SetAccess];
        assert_eq!(
            m.estimate_us(&c, &ops, Calibration::PerByte),
            (10 * 36_189 + 10 * 104) as f64 / 1e3
        );
        assert_eq!(
            m.estimate_us(&c, &ops, Calibration::PerCall),
            (36_189 + 104) as f64 / 1e3
        );
        assert_eq!(LatencyModel::named("H100"), Some(m));
        assert_eq!(LatencyModel::named("a100"), Some(LatencyModel::a100()));
        assert_eq!(LatencyModel::named("v100"), None);
        // The A100 figures have no fixed part: extra mappings change nothing there.
        let a = LatencyModel::a100();
        assert_eq!(a.estimate_us(&c, &ops, Calibration::PerByte), 360.0);
    }
}
