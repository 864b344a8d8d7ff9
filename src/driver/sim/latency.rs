//! The latency model: how long each simulated driver call would have taken on a real device.
//!
//! A call of an operation costs a fixed amount plus an amount per byte it covers. Only one figure per
//! operation is known (its latency on a 2 MiB range, [`LatencyModel::a100`]), which cannot tell the two
//! apart, so estimates are given under both extreme calibrations ([`Calibration`]): all of it per call,
//! or all of it per 2 MiB unit (what the simulator's clock charges). PyTorch's note on expandable segments
//! says map and unmap cost grows with the number of handles, which is the per-call end; the truth for
//! each operation lies between the two until it is measured on a GPU (`cuvmm driver-bench`).

use crate::driver::{DriverCounters, Op};
use crate::size::MIB;

/// The size one [`LatencyModel::per_call_ns`] entry is quoted for: one 2 MiB page.
pub const LATENCY_UNIT_BYTES: u64 = 2 * MIB;

/// Per-call driver latency, in nanoseconds, for one call on one granularity-sized (2 MiB) page.
/// Calls on larger ranges cost proportionally more (see [`LatencyModel::cost_ns`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyModel {
    /// Nanoseconds per call of each operation, indexed like [`Op::ALL`], for a 2 MiB range.
    pub per_call_ns: [u64; Op::ALL.len()],
}

impl LatencyModel {
    /// Published A100 figures for 2 MiB pages: create 193 us, map 1.5 us, set_access 36 us, unmap 26 us;
    /// release as unmap until measured.
    ///
    /// Only those four are measurements. Every other figure is an **assumption** chosen to be plausible,
    /// not measured, and should be replaced when real numbers are taken:
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
    /// | copy_to_host | 10 000 | assumed (a small synchronous copy over PCIe) |
    pub fn a100() -> Self {
        let mut model = Self::zero();
        for op in Op::ALL {
            model.per_call_ns[op as usize] = match op {
                Op::Create => 193_000,
                Op::Map => 1_500,
                Op::SetAccess => 36_000,
                Op::Unmap | Op::Release => 26_000,
                Op::Malloc => 193_000 + 1_500 + 36_000,
                Op::Free => 26_000 + 26_000,
                Op::Reserve | Op::FreeReservation | Op::Synchronize => 5_000,
                Op::MemInfo | Op::RecordEvent | Op::QueryEvent | Op::DestroyEvent => 1_000,
                Op::Memset | Op::CopyToHost => 10_000,
            };
        }
        model
    }

    /// A model in which every call is free: counters still count calls, but the time stays 0.
    pub fn zero() -> Self {
        Self {
            per_call_ns: [0; Op::ALL.len()],
        }
    }

    /// Nanoseconds per 2 MiB unit of one operation.
    #[inline]
    pub fn per_call(&self, op: Op) -> u64 {
        self.per_call_ns[op as usize]
    }

    /// Estimated nanoseconds for one call of `op` covering `bytes` bytes.
    ///
    /// Operations that carry a size (create, release, map, set_access, unmap, malloc, free, memset,
    /// copy_to_host; for release and free the size of the handle or allocation) cost `per_call_ns[op] * max(1, ceil(bytes / 2 MiB))`:
    /// a 4 MiB map costs two units, a 64 KiB one costs one unit whatever the device's granularity.
    /// Every other operation costs `per_call_ns[op]` flat. Saturates instead of overflowing.
    pub fn cost_ns(&self, op: Op, bytes: u64) -> u64 {
        self.charge(op, bytes).0
    }

    /// [`cost_ns`](Self::cost_ns) and [`units`](Self::units) of one call, together: the cost is
    /// `per_call_ns[op]` per unit.
    #[inline(always)]
    pub(super) fn charge(&self, op: Op, bytes: u64) -> (u64, u64) {
        let units = Self::units(op, bytes);
        (self.per_call(op).saturating_mul(units), units)
    }
}

/// How a [`LatencyModel`] figure, quoted for a 2 MiB range, splits into a fixed and a per-byte cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Calibration {
    /// All of it per call, whatever the size: a 20 MiB create costs what a 2 MiB one does.
    PerCall,
    /// All of it per 2 MiB unit (at least one per call): a 20 MiB create costs ten 2 MiB ones.
    PerByte,
}

impl Calibration {
    /// Both, per call first.
    pub const BOTH: [Calibration; 2] = [Calibration::PerCall, Calibration::PerByte];
}

/// Where the figures of [`LatencyModel::a100`] come from, for reports.
pub const LATENCY_SOURCES: &str = "A100, 2 MiB: create 193 us, map 1.5 us, set_access 36 us, unmap 26 us \
     (published measurements quoted in docs/DESIGN.md); every other figure is an assumption. per_call: each \
     figure is a fixed cost per call; per_byte: each is a cost per 2 MiB unit covered (the simulator's \
     clock). Covers the calls counted in driver_calls; event calls and synchronizations are counted apart.";

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
    /// units a simulator records).
    pub fn estimate_us(
        &self,
        counters: &DriverCounters,
        ops: &[Op],
        calibration: Calibration,
    ) -> f64 {
        let ns: u128 = ops
            .iter()
            .map(|&op| {
                let count = match calibration {
                    Calibration::PerCall => counters.get(op),
                    Calibration::PerByte if carries_size(op) => counters.units[op as usize],
                    Calibration::PerByte => counters.get(op),
                };
                count as u128 * self.per_call(op) as u128
            })
            .sum();
        ns as f64 / 1_000.0
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
        huge.per_call_ns[Op::Map as usize] = u64::MAX / 2 + 1;
        assert_eq!(huge.cost_ns(Op::Map, 4 * MIB), u64::MAX);
    }
}
