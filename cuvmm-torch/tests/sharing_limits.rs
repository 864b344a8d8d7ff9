//! A model's parameters sent to another process one tensor at a time (`torch.multiprocessing`, as RL
//! frameworks send weights to inference workers) fit a process's open-file limit: the sender holds a
//! descriptor per physical handle, not one per tensor. In a test binary of its own: it lowers the process's
//! soft RLIMIT_NOFILE, which would starve tests running beside it.

use cuvmm::StreamId;
use cuvmm_torch::registry::{Registry, Settings};
use cuvmm_torch::sharing;
use rustix::process::{Resource, getrlimit, setrlimit};

/// The soft limit while sharing: far fewer descriptors than the tensors shared.
const LIMIT: u64 = 256;

#[test]
fn thousands_of_small_tensors_are_shared_within_a_low_open_file_limit() {
    let registry = Registry::new(Settings::sim(8 << 30, 1));
    let allocator = registry.allocator(0).expect("the simulated device");
    // Biases and norms (4 KB each, in the small pool's 2 MiB pages) and matrices of 1.5 MiB (in 20 MiB
    // chunks): 2200 tensors on about 20 handles.
    let sizes = (0..2000).map(|_| 4000).chain((0..200).map(|_| 3 << 19));
    let tensors: Vec<u64> = sizes
        .map(|size| allocator.alloc_raw(size, StreamId(7)).expect("allocated"))
        .collect();

    let saved = getrlimit(Resource::Nofile);
    let mut low = saved;
    low.current = Some(LIMIT);
    setrlimit(Resource::Nofile, low).expect("the soft limit can be lowered");
    let shared: Vec<_> = (tensors.iter())
        .map(|&ptr| sharing::share(&registry, 0, ptr))
        .collect();
    setrlimit(Resource::Nofile, saved).expect("the soft limit can be restored");

    for (result, ptr) in shared.iter().zip(&tensors) {
        if let Err(err) = result {
            panic!("sharing {ptr:#x} within {LIMIT} descriptors: {err}");
        }
    }
    assert_eq!(sharing::pending_exports(), tensors.len());
    let opened = sharing::open(&registry, 0, &shared[1999].as_ref().expect("shared").0)
        .expect("a small tensor's handle opens");
    sharing::close(&registry, 0, opened).expect("closed");
    for ptr in tensors {
        sharing::forget(&registry, 0, ptr);
        allocator.free_raw(ptr).expect("freed");
    }
    assert_eq!(sharing::pending_exports(), 0);
    allocator.check_invariants().expect("the invariants hold");
}
