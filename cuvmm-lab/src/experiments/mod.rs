//! The experiments the `cuvmm` tool runs, one per subcommand: [`compare`] replays workloads through
//! allocators; [`capacity`] finds the smallest device each allocator fits on; [`frontier`] what each costs
//! on devices of each size; [`fidelity`] checks the PyTorch models against real PyTorch; [`bench`](mod@bench)
//! measures replay throughput; [`driver_bench`] what each virtual-memory call costs on a device.

pub mod bench;
pub mod capacity;
pub mod compare;
pub mod driver_bench;
pub mod fidelity;
pub mod frontier;
