//! An importer at its open-file limit gets the typed "truncated, raise `ulimit -n`" error, not a short
//! export. In a test binary of its own: it lowers the process's soft RLIMIT_NOFILE, which would starve
//! tests running beside it.

use cuvmm_torch::TransportError;
use cuvmm_torch::transport::{self, Exports};
use rustix::io::fcntl_dupfd_cloexec;
use rustix::process::{Resource, getrlimit, setrlimit};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// Hands out descriptors made in advance, so the server needs no new ones once the limit is low.
struct Prepared(Mutex<Vec<OwnedFd>>);

impl Exports for Prepared {
    fn descriptors(&self, _id: u64) -> Result<Vec<OwnedFd>, String> {
        Ok(std::mem::take(
            &mut *self.0.lock().map_err(|e| e.to_string())?,
        ))
    }
}

/// Below this soft limit every descriptor number but a few is taken while the export is in flight. It
/// stays above the 300 in flight, or the kernel refuses the server's `sendmsg` (`ETOOMANYREFS`).
const LOW_LIMIT: i32 = 400;

#[test]
fn descriptors_dropped_at_the_open_file_limit_are_a_typed_error() {
    let saved = getrlimit(Resource::Nofile);
    let mut roomy = saved;
    roomy.current = saved.maximum.map_or(Some(4096), |max| Some(max.min(4096)));
    setrlimit(Resource::Nofile, roomy).expect("the soft limit can rise");

    // The export's descriptors lie above the low limit, so the server closing them once sent frees no
    // number the importer could use; fillers take the numbers below it but the last few.
    let (exported, _peers): (Vec<OwnedFd>, Vec<UnixStream>) = (0..300)
        .map(|_| UnixStream::pair().expect("a socket pair"))
        .map(|(ours, peer)| {
            (
                fcntl_dupfd_cloexec(ours, LOW_LIMIT + 100).expect("dup"),
                peer,
            )
        })
        .unzip();
    let mut fillers = Vec::new();
    loop {
        let filler = File::open("/dev/null").expect("/dev/null opens");
        if filler.as_raw_fd() >= LOW_LIMIT - 10 {
            break;
        }
        fillers.push(filler);
    }
    let address =
        transport::start(Arc::new(Prepared(Mutex::new(exported)))).expect("the server starts");

    let mut low = saved;
    low.current = Some(LOW_LIMIT as u64);
    setrlimit(Resource::Nofile, low).expect("the soft limit can be lowered");
    let fetched = transport::fetch(&address, 1);
    setrlimit(Resource::Nofile, saved).expect("the soft limit can be restored");

    match fetched {
        Err(error @ TransportError::Truncated { .. }) => {
            assert!(
                error.to_string().contains("ulimit -n"),
                "the message says what to do: {error}"
            );
        }
        other => panic!("expected the truncated error, got {other:?}"),
    }
}
