//! The IPC transport end to end in one process: a server started with `transport::start` serves
//! descriptors of socket pairs into which it wrote known bytes; a client on another thread fetches them
//! and reads the bytes back through the received descriptors, which proves they are the same objects.
//!
//! Checked: the descriptors arrive whole and in order (one batch and several), they are the exporter's
//! objects (same bytes, same inode), an unknown id gives the exporter's text, a client sending garbage or
//! stalling does not stop the server answering others, a name nobody serves gives the typed "gone"
//! error, and `serve` is idempotent. One test runs this binary again as a child process that fetches
//! from its parent's server, as torch.multiprocessing's receiver does.

use cuvmm_torch::TransportError;
use cuvmm_torch::transport::{self, Address, BATCH, Batch, Exports};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Export `id` is `count` socket-pair ends, the `i`th holding the bytes `payload(id, i)`; id 0 is unknown.
/// Also keeps an end of export 1's pair so a test can compare inodes.
struct Payloads {
    count: usize,
    kept: Mutex<Option<UnixStream>>,
}

fn payload(id: u64, i: usize) -> Vec<u8> {
    format!("export {id} descriptor {i}").into_bytes()
}

impl Exports for Payloads {
    fn descriptors(&self, id: u64) -> Result<Vec<OwnedFd>, String> {
        if id == 0 {
            return Err("the exporting process freed that memory".into());
        }
        (0..self.count)
            .map(|i| {
                let (mut writer, reader) = UnixStream::pair().map_err(|e| e.to_string())?;
                writer
                    .write_all(&payload(id, i))
                    .map_err(|e| e.to_string())?;
                if i == 0 {
                    *self.kept.lock().map_err(|e| e.to_string())? =
                        Some(reader.try_clone().map_err(|e| e.to_string())?);
                }
                Ok(OwnedFd::from(reader)) // the writer closes here: the reader sees the bytes, then EOF
            })
            .collect()
    }
}

fn server(count: usize) -> (Address, Arc<Payloads>) {
    let exports = Arc::new(Payloads {
        count,
        kept: Mutex::new(None),
    });
    let address = transport::start(exports.clone()).expect("the server starts");
    (address, exports)
}

fn read_all(fd: OwnedFd) -> Vec<u8> {
    let mut bytes = Vec::new();
    UnixStream::from(fd)
        .read_to_end(&mut bytes)
        .expect("the received descriptor reads");
    bytes
}

/// Raises the soft limit on open files to the hard limit (at most 8192), for the large export.
fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    let wanted = limit.maximum.map_or(8192, |max| max.min(8192));
    if limit.current.is_some_and(|current| current < wanted) {
        limit.current = Some(wanted);
        setrlimit(Resource::Nofile, limit).expect("the soft limit can rise to the hard limit");
    }
}

#[test]
fn fetched_descriptors_are_the_exporters_objects() {
    let (address, exports) = server(3);
    let received = std::thread::spawn(move || transport::fetch(&address, 7))
        .join()
        .expect("no panic");
    let received = received.expect("fetch succeeds");
    assert_eq!(received.len(), 3);
    let kept = exports
        .kept
        .lock()
        .unwrap()
        .take()
        .expect("the exporter kept descriptor 0");
    let kept_inode = File::from(OwnedFd::from(kept)).metadata().unwrap().ino();
    let first_inode = File::from(received[0].try_clone().unwrap())
        .metadata()
        .unwrap()
        .ino();
    assert_eq!(
        first_inode, kept_inode,
        "descriptor 0 is the exporter's socket"
    );
    for (i, fd) in received.into_iter().enumerate() {
        assert_eq!(
            read_all(fd),
            payload(7, i),
            "descriptor {i} carries its bytes"
        );
    }
}

#[test]
fn a_large_export_arrives_whole_in_batches() {
    raise_open_file_limit();
    let count = 600;
    let (address, _exports) = server(count);
    let mut batches = Vec::new();
    let mut next = 0;
    transport::fetch_each(&address, 42, |batch: Batch| {
        assert_eq!(batch.offset, next, "batches arrive in order");
        assert_eq!(batch.total, count);
        assert!(batch.descriptors.len() <= BATCH);
        batches.push(batch.descriptors.len());
        for fd in batch.descriptors {
            assert_eq!(
                read_all(fd),
                payload(42, next),
                "descriptor {next} carries its bytes"
            );
            next += 1;
        }
        Ok::<(), TransportError>(())
    })
    .expect("fetch succeeds");
    assert_eq!(next, count);
    assert_eq!(batches, [250, 250, 100]);
}

#[test]
fn an_empty_export_arrives_empty() {
    let (address, _exports) = server(0);
    assert!(
        transport::fetch(&address, 3)
            .expect("fetch succeeds")
            .is_empty()
    );
}

#[test]
fn an_unknown_id_gives_the_exporters_text() {
    let (address, _exports) = server(2);
    match transport::fetch(&address, 0) {
        Err(TransportError::Refused { id: 0, message }) => {
            assert_eq!(message, "the exporting process freed that memory");
        }
        other => panic!("expected the exporter's refusal, got {other:?}"),
    }
}

#[test]
fn garbage_and_stalled_clients_do_not_stop_the_server() {
    let (address, _exports) = server(1);
    let addr = SocketAddr::from_abstract_name(address.as_bytes()).unwrap();
    // A client that connects and says nothing holds its connection open throughout.
    let _stalled = UnixStream::connect_addr(&addr).unwrap();
    // A client that sends garbage gets an error frame (kind 1) and is disconnected.
    let mut garbage = UnixStream::connect_addr(&addr).unwrap();
    garbage
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // (Read exactly the frame: the server closes with our extra bytes unread, so a read past it is reset.)
    let mut header = [0u8; 16];
    garbage.read_exact(&mut header).expect("the server answers");
    assert_eq!(&header[..4], b"CVMR");
    assert_eq!(header[4..8], 1u32.to_le_bytes(), "an error frame");
    let mut text = vec![0u8; u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize];
    garbage
        .read_exact(&mut text)
        .expect("the error text follows");
    assert!(String::from_utf8_lossy(&text).contains("not a cuvmm request"));
    // A client that disconnects mid-request.
    UnixStream::connect_addr(&addr)
        .unwrap()
        .write_all(b"cuvmm")
        .unwrap();
    // The next importer is served at once, well within the stalled client's timeout.
    let started = Instant::now();
    let received = transport::fetch(&address, 9).expect("fetch succeeds");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "served without waiting on the stalled client"
    );
    assert_eq!(
        read_all(received.into_iter().next().unwrap()),
        payload(9, 0)
    );
}

#[test]
fn nobody_serving_the_address_is_the_typed_gone_error() {
    let address = Address::from_bytes(b"cuvmm-ipc.0.no-such-server").unwrap();
    assert!(matches!(
        transport::fetch(&address, 1),
        Err(TransportError::Gone { .. })
    ));
}

#[test]
fn addresses_round_trip_and_foreign_names_are_refused() {
    let (address, _exports) = server(0);
    assert_eq!(Address::from_bytes(address.as_bytes()).unwrap(), address);
    assert!(address.to_string().starts_with("@cuvmm-ipc."));
    assert!(matches!(
        Address::from_bytes(b"/tmp/.X11-unix/X0"),
        Err(TransportError::InvalidAddress { .. })
    ));
    let long = [b"cuvmm-ipc.".as_slice(), &[b'x'; 98]].concat();
    assert!(matches!(
        Address::from_bytes(&long),
        Err(TransportError::InvalidAddress { .. })
    ));
}

#[test]
fn serve_is_idempotent() {
    let first = transport::serve(Arc::new(Payloads {
        count: 1,
        kept: Mutex::new(None),
    }))
    .unwrap();
    let second = transport::serve(Arc::new(Payloads {
        count: 5,
        kept: Mutex::new(None),
    }))
    .unwrap();
    assert_eq!(first, second);
    assert_eq!(
        transport::fetch(&second, 4).unwrap().len(),
        1,
        "the first exports are kept"
    );
}

/// The variable that turns [`child_fetches_from_its_parent`] into the importing child of
/// [`another_process_fetches_the_descriptors`]: the parent's address, the export id and the count, as
/// `address-hex,id,count`.
const CHILD_VAR: &str = "CUVMM_TRANSPORT_TEST_CHILD";

/// Another process (this test binary run again, as a child) fetches an export from this process's server
/// and reads the bytes through the received descriptors: what torch.multiprocessing's receiver does.
#[test]
fn another_process_fetches_the_descriptors() {
    let (address, _exports) = server(3);
    let hex: String = address
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_fetches_from_its_parent",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, format!("{hex},7,3"))
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("fetched 3 descriptors from the parent"),
        "the child failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Run alone, does nothing; run by [`another_process_fetches_the_descriptors`], is its child.
#[test]
fn child_fetches_from_its_parent() {
    let Ok(spec) = std::env::var(CHILD_VAR) else {
        return;
    };
    let fields: Vec<&str> = spec.split(',').collect();
    let bytes: Vec<u8> = (0..fields[0].len() / 2)
        .map(|i| u8::from_str_radix(&fields[0][2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let address = Address::from_bytes(&bytes).unwrap();
    let (id, count): (u64, usize) = (fields[1].parse().unwrap(), fields[2].parse().unwrap());
    let fds = transport::fetch(&address, id).expect("the child fetches from its parent");
    assert_eq!(fds.len(), count);
    for (i, fd) in fds.into_iter().enumerate() {
        assert_eq!(
            read_all(fd),
            payload(id, i),
            "descriptor {i} is the parent's object"
        );
    }
    println!("fetched {count} descriptors from the parent");
}
