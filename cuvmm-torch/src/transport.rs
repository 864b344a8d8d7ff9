//! Passing exported memory's file descriptors to another process over a Unix socket (`SCM_RIGHTS`).
//!
//! A descriptor number means nothing in another process, so the importer must receive the descriptors
//! themselves. PyTorch's expandable segments take them with `pidfd_getfd`, which needs ptrace permission
//! and fails under Yama `ptrace_scope=1` when a child asks its parent; cuvmm instead has the exporting
//! process serve them on an abstract Unix socket ([`Address`]), and the importer [`fetch`]es an export by
//! its id. An abstract socket leaves no file behind and has no file permissions, so the server checks
//! each peer's credentials and serves only its own uid; the importer likewise refuses a server of
//! another uid.
//!
//! **One server per process.** [`serve`] starts the process's server on first use and returns the same
//! [`Address`] afterwards (the first [`Exports`] is kept): PyTorch's `shareIpcHandle` may run on any
//! thread, and one name per process keeps the handle strings short and the listening sockets few. The
//! accept thread lives as long as the process, as the exports it serves do. [`start`] starts an extra,
//! independent server; the tests use it to serve different [`Exports`] in one process.
//!
//! **One thread per connection.** The accept thread checks the peer's uid, then hands the connection to
//! a thread of its own with 10 s read and write timeouts, so a client that stalls, disconnects mid-way
//! or sends garbage costs one short-lived thread and never delays another importer. Connections are
//! few (one per imported tensor), so a pool would buy nothing.
//!
//! **The protocol** (all integers little-endian). The importer sends one request: the magic `cuvmmipc`,
//! the version (u32), zero (u32) and the id (u64). The server answers with frames of a 16-byte header:
//! the magic `CVMR`, a kind (u32), then two u32. A batch frame (kind 0) carries `count, total` and
//! `count` descriptors (at most [`BATCH`]; `SCM_RIGHTS` takes at most 253) attached with `SCM_RIGHTS`;
//! batches follow until `total` descriptors are sent (one empty batch for an empty export). An error
//! frame (kind 1) carries the text's length and zero, then the text (the exporter's words, at most
//! [`MAX_ERROR_TEXT`] bytes). The server closes each descriptor once sent; the importer may take them
//! batch by batch ([`fetch_each`]) so it needs no more than one batch open beyond what it keeps.
//!
//! Failures are [`TransportError`]s (wrapped in the crate's [`AbiError`](crate::AbiError)), each
//! saying what the user can do: the exporter is gone, its refusal in its own words, a protocol mismatch,
//! a timeout, or descriptors dropped at this process's open-file limit.

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use rustix::process::{Resource, Uid};
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

/// The most descriptors sent in one message (the kernel's `SCM_MAX_FD` is 253).
pub const BATCH: usize = 250;
/// The longest error text a server sends; longer texts are cut.
pub const MAX_ERROR_TEXT: usize = 4096;
/// How long either side waits for the other before giving up on a connection.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// The prefix of every socket name cuvmm serves on; [`Address::from_bytes`] accepts no other.
pub const NAME_PREFIX: &str = "cuvmm-ipc.";

const REQUEST_MAGIC: [u8; 8] = *b"cuvmmipc";
const REPLY_MAGIC: [u8; 4] = *b"CVMR";
const VERSION: u32 = 1;
const REQUEST_LEN: usize = 24;
const HEADER_LEN: usize = 16;
const KIND_BATCH: u32 = 0;
const KIND_ERROR: u32 = 1;
/// The longest abstract name: `sun_path` is 108 bytes, the first of them the NUL that marks it abstract.
const MAX_NAME: usize = 107;

/// Why serving or fetching exported memory's descriptors failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Bytes that are not a cuvmm socket name.
    #[error("invalid cuvmm IPC address {name:?}: {reason}")]
    InvalidAddress {
        /// The bytes given, shown with non-printable bytes escaped.
        name: String,
        /// What is wrong with them.
        reason: &'static str,
    },
    /// Nobody listens at the address: the exporting process has exited or never served exports.
    #[error(
        "the exporting process is gone or serves no cuvmm exports (nothing listens at {address})"
    )]
    Gone {
        /// The address tried.
        address: Address,
    },
    /// The other side did not answer within [`TIMEOUT`].
    #[error("{address} did not answer within {} s while {doing}", TIMEOUT.as_secs())]
    Timeout {
        /// The server's address.
        address: Address,
        /// What this side was doing.
        doing: &'static str,
    },
    /// The exporting process closed the connection before sending everything.
    #[error("the exporting process at {address} closed the connection while {doing}")]
    Disconnected {
        /// The server's address.
        address: Address,
        /// What this side was doing.
        doing: &'static str,
    },
    /// The server's replies do not follow this version's protocol.
    #[error("protocol mismatch with {address}: {detail} (do both processes load the same cuvmm?)")]
    Protocol {
        /// The server's address.
        address: Address,
        /// What was wrong.
        detail: String,
    },
    /// The exporting process refused the request; its words (e.g. that it freed the memory).
    #[error("the exporting process refused export {id:#018x}: {message}")]
    Refused {
        /// The export asked for.
        id: u64,
        /// The exporter's text.
        message: String,
    },
    /// The kernel dropped descriptors in transit (`MSG_CTRUNC`).
    #[error(
        "descriptors of export {id:#018x} were dropped in transit (MSG_CTRUNC), most likely because this \
         process reached its open-file limit (soft RLIMIT_NOFILE {limit}); raise it with `ulimit -n`"
    )]
    Truncated {
        /// The export asked for.
        id: u64,
        /// This process's soft limit on open files, or `unlimited`.
        limit: String,
    },
    /// The socket at the address belongs to another user, so its descriptors are not trusted.
    #[error(
        "{address} is served by uid {uid}, not this process's uid {own}: refusing its descriptors"
    )]
    ForeignServer {
        /// The server's address.
        address: Address,
        /// The server's uid.
        uid: u32,
        /// This process's uid.
        own: u32,
    },
    /// A system call failed.
    #[error("{doing}: {source}")]
    Io {
        /// What was being done.
        doing: String,
        /// The error.
        source: io::Error,
    },
}

/// Where an exporting process serves its exports: an abstract Unix socket name such as
/// `cuvmm-ipc.<pid>.<random>`, written into the handle string as [`Address::as_bytes`] and read back
/// with [`Address::from_bytes`]. Displays as `@name`, as `ss` shows abstract sockets.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Address(Vec<u8>);

impl Address {
    /// The name's bytes, to write into a handle string.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Reads a name written by [`Address::as_bytes`]: it must start with [`NAME_PREFIX`] and fit an
    /// abstract socket name (at most 107 bytes).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TransportError> {
        let invalid = |reason| TransportError::InvalidAddress {
            name: bytes.escape_ascii().to_string(),
            reason,
        };
        if !bytes.starts_with(NAME_PREFIX.as_bytes()) {
            return Err(invalid("it does not start with \"cuvmm-ipc.\""));
        }
        if bytes.len() > MAX_NAME {
            return Err(invalid("it is longer than 107 bytes"));
        }
        Ok(Self(bytes.to_vec()))
    }

    fn socket_addr(&self) -> io::Result<SocketAddr> {
        SocketAddr::from_abstract_name(&self.0)
    }

    /// A fresh name for this process: its pid and 64 random bits.
    fn fresh() -> Self {
        let name = format!("{NAME_PREFIX}{}.{:016x}", std::process::id(), random_u64());
        Self(name.into_bytes())
    }
}

/// 64 bits no other process can guess: the standard library's randomly seeded hasher, fed the pid and the
/// time. They name the server's socket, and each export (`sharing.rs`).
pub fn random_u64() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    hasher.finish()
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}", self.0.escape_ascii())
    }
}

impl fmt::Debug for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Address({self})")
    }
}

/// What a server asks its process for: the descriptors of an export.
///
/// Implementors return new descriptors (duplicates, or freshly exported handles) that the server may
/// close once sent, or a text saying why not (an unknown id: "the exporting process freed that
/// memory"); the text reaches the importer in [`TransportError::Refused`]. Called from the server's
/// connection threads, possibly several at once.
pub trait Exports: Send + Sync + 'static {
    /// The descriptors of export `id`, in the order the importer should receive them.
    fn descriptors(&self, id: u64) -> Result<Vec<OwnedFd>, String>;
}

/// Descriptors of one batch, handed to [`fetch_each`]'s consumer.
#[derive(Debug)]
pub struct Batch {
    /// The descriptors, close-on-exec; at most [`BATCH`].
    pub descriptors: Vec<OwnedFd>,
    /// The export's index of the first of them.
    pub offset: usize,
    /// How many descriptors the export has in all.
    pub total: usize,
}

/// The process's one server, started on first use: a thread accepting connections for the life of the
/// process. A later call returns the same address and drops its `exports` (the first are kept).
pub fn serve(exports: Arc<dyn Exports>) -> Result<Address, TransportError> {
    static SERVER: Mutex<Option<Address>> = Mutex::new(None);
    let mut server = SERVER.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(address) = server.as_ref() {
        return Ok(address.clone());
    }
    let address = start(exports)?;
    *server = Some(address.clone());
    Ok(address)
}

/// Starts an independent server for `exports` on a fresh address; its thread accepts connections for
/// the life of the process. Most callers want [`serve`].
pub fn start(exports: Arc<dyn Exports>) -> Result<Address, TransportError> {
    let (listener, address) = bind()?;
    let own = rustix::process::getuid();
    std::thread::Builder::new()
        .name("cuvmm-ipc".into())
        .spawn(move || accept_loop(&listener, &exports, own))
        .map_err(|source| TransportError::Io {
            doing: "cannot start the cuvmm IPC server thread".into(),
            source,
        })?;
    tracing::debug!(%address, "cuvmm IPC server started");
    Ok(address)
}

/// Binds a fresh name, trying another in the unlikely case that one is taken.
fn bind() -> Result<(UnixListener, Address), TransportError> {
    let mut attempts = 0;
    loop {
        let address = Address::fresh();
        let bound = address
            .socket_addr()
            .and_then(|addr| UnixListener::bind_addr(&addr));
        match bound {
            Ok(listener) => return Ok((listener, address)),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && attempts < 8 => attempts += 1,
            Err(source) => {
                return Err(TransportError::Io {
                    doing: format!("cannot listen on {address}"),
                    source,
                });
            }
        }
    }
}

fn accept_loop(listener: &UnixListener, exports: &Arc<dyn Exports>, own: Uid) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => admit(stream, exports, own),
            Err(e) => {
                // Out of descriptors or memory: wait rather than spin; the listener itself stays usable.
                tracing::warn!("cuvmm IPC server: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Checks the peer's uid on the accept thread, then answers on a thread of the connection's own.
fn admit(stream: UnixStream, exports: &Arc<dyn Exports>, own: Uid) {
    if let Err(e) = set_timeouts(&stream) {
        tracing::warn!("cuvmm IPC server: cannot set timeouts: {e}");
        return;
    }
    match rustix::net::sockopt::socket_peercred(&stream) {
        Ok(peer) if peer.uid == own => {}
        Ok(peer) => {
            let (uid, pid) = (peer.uid.as_raw(), peer.pid.as_raw_nonzero());
            let text = format!(
                "uid {uid} may not import from a process of uid {}",
                own.as_raw()
            );
            tracing::warn!("cuvmm IPC server: refused pid {pid}: {text}");
            if let Err(e) = send_error(&stream, &text) {
                tracing::debug!("cuvmm IPC server: refusal not sent: {e}");
            }
            return;
        }
        Err(e) => {
            tracing::warn!("cuvmm IPC server: cannot read the peer's credentials: {e}");
            return;
        }
    }
    let exports = Arc::clone(exports);
    let spawned = std::thread::Builder::new()
        .name("cuvmm-ipc-conn".into())
        .spawn(move || answer(&stream, exports.as_ref()));
    if let Err(e) = spawned {
        tracing::warn!("cuvmm IPC server: cannot start a connection thread: {e}");
    }
}

/// Reads one request and sends the export's descriptors or the reason it cannot.
fn answer(stream: &UnixStream, exports: &dyn Exports) {
    let mut request = [0u8; REQUEST_LEN];
    if let Err(e) = (&*stream).read_exact(&mut request) {
        tracing::debug!("cuvmm IPC server: no request read: {e}");
        return;
    }
    let outcome = match parse_request(&request) {
        Err(text) => send_error(stream, &text),
        Ok(id) => match exports.descriptors(id) {
            Err(text) => send_error(stream, &text),
            Ok(fds) => send_descriptors(stream, &fds),
        },
    };
    // The descriptors are closed here, sent or not.
    if let Err(e) = outcome {
        tracing::debug!("cuvmm IPC server: reply not sent: {e}");
    }
}

fn parse_request(request: &[u8; REQUEST_LEN]) -> Result<u64, String> {
    let (magic, rest) = request.split_at(8);
    if magic != REQUEST_MAGIC {
        return Err(format!(
            "not a cuvmm request (magic {:?})",
            magic.escape_ascii().to_string()
        ));
    }
    let version = u32::from_le_bytes(bytes_at(rest, 0));
    if version != VERSION {
        return Err(format!(
            "request version {version}, this process speaks version {VERSION}"
        ));
    }
    Ok(u64::from_le_bytes(bytes_at(rest, 8)))
}

fn send_descriptors(stream: &UnixStream, fds: &[OwnedFd]) -> io::Result<()> {
    let total =
        u32::try_from(fds.len()).map_err(|_| io::Error::other("more than 2^32 descriptors"))?;
    if fds.is_empty() {
        return send_batch(stream, &[], total);
    }
    fds.chunks(BATCH)
        .try_for_each(|chunk| send_batch(stream, chunk, total))
}

fn send_batch(stream: &UnixStream, fds: &[OwnedFd], total: u32) -> io::Result<()> {
    let header = reply_header(KIND_BATCH, fds.len() as u32, total); // fds.len() <= BATCH
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(borrowed.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
        return Err(io::Error::other("the control buffer is too small"));
    }
    let sent = rustix::net::sendmsg(
        stream,
        &[IoSlice::new(&header)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    // The descriptors went with the first byte; the rest of a short write goes plain.
    send_all(stream, &header[sent..])
}

fn send_error(stream: &UnixStream, text: &str) -> io::Result<()> {
    let mut end = text.len().min(MAX_ERROR_TEXT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let text = &text.as_bytes()[..end];
    send_all(stream, &reply_header(KIND_ERROR, end as u32, 0))?; // end <= MAX_ERROR_TEXT
    send_all(stream, text)
}

fn set_timeouts(stream: &UnixStream) -> io::Result<()> {
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))
}

/// Writes all of `bytes` without raising SIGPIPE in a host that has not ignored it.
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match rustix::net::send(stream, bytes, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn reply_header(kind: u32, a: u32, b: u32) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&REPLY_MAGIC);
    header[4..8].copy_from_slice(&kind.to_le_bytes());
    header[8..12].copy_from_slice(&a.to_le_bytes());
    header[12..].copy_from_slice(&b.to_le_bytes());
    header
}

/// The `N` bytes at `at` (the callers' offsets are constants within their fixed-size messages).
fn bytes_at<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut word = [0u8; N];
    word.copy_from_slice(&bytes[at..at + N]);
    word
}

/// Connects to `address`, asks for export `id` and returns all its descriptors, in order.
pub fn fetch(address: &Address, id: u64) -> Result<Vec<OwnedFd>, TransportError> {
    let mut all = Vec::new();
    fetch_each(address, id, |batch: Batch| {
        all.extend(batch.descriptors);
        Ok::<(), TransportError>(())
    })?;
    Ok(all)
}

/// Connects to `address`, asks for export `id` and hands its descriptors to `consume` batch by batch,
/// in order, so no more than one batch is open beyond what `consume` keeps. Stops at `consume`'s first
/// error; the descriptors not yet received are closed with the connection.
pub fn fetch_each<E, F>(address: &Address, id: u64, mut consume: F) -> Result<(), E>
where
    E: From<TransportError>,
    F: FnMut(Batch) -> Result<(), E>,
{
    let client = Client::connect(address)?;
    client.request(id)?;
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(BATCH))];
    let mut offset = 0usize;
    let mut expected = None;
    loop {
        let (header, descriptors) = client.receive(id, &mut space)?;
        let (count, total) = client.parse_header(id, &header, &descriptors)?;
        let first_total = *expected.get_or_insert(total);
        if first_total != total || (count == 0 && total != 0) || offset + count > total {
            let detail =
                format!("a batch of {count} at {offset} of {total} (first said {first_total})");
            return Err(client.protocol(detail).into());
        }
        consume(Batch {
            descriptors,
            offset,
            total,
        })?;
        offset += count;
        if offset == total {
            return Ok(());
        }
    }
}

/// The importer's side of one connection.
struct Client<'a> {
    stream: UnixStream,
    address: &'a Address,
}

impl<'a> Client<'a> {
    fn connect(address: &'a Address) -> Result<Self, TransportError> {
        let io_error = |doing: &str, source| TransportError::Io {
            doing: format!("{doing} {address}"),
            source,
        };
        let addr = address
            .socket_addr()
            .map_err(|e| io_error("invalid address", e))?;
        let stream = UnixStream::connect_addr(&addr).map_err(|e| match e.kind() {
            io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => TransportError::Gone {
                address: address.clone(),
            },
            _ => io_error("cannot connect to", e),
        })?;
        set_timeouts(&stream)
            .map_err(|e| io_error("cannot set timeouts on the connection to", e))?;
        let peer = rustix::net::sockopt::socket_peercred(&stream)
            .map_err(|e| io_error("cannot read the credentials of", e.into()))?;
        let own = rustix::process::getuid();
        if peer.uid != own {
            let (uid, own) = (peer.uid.as_raw(), own.as_raw());
            return Err(TransportError::ForeignServer {
                address: address.clone(),
                uid,
                own,
            });
        }
        Ok(Self { stream, address })
    }

    fn request(&self, id: u64) -> Result<(), TransportError> {
        let mut request = [0u8; REQUEST_LEN];
        request[..8].copy_from_slice(&REQUEST_MAGIC);
        request[8..12].copy_from_slice(&VERSION.to_le_bytes());
        request[16..].copy_from_slice(&id.to_le_bytes());
        send_all(&self.stream, &request).map_err(|e| self.failed("sending the request", e))
    }

    /// Receives one frame's header and the descriptors attached to it. The header is read with as many
    /// `recvmsg` calls as it takes, never past its end, so no descriptor of the next frame comes along.
    fn receive(
        &self,
        id: u64,
        space: &mut [MaybeUninit<u8>],
    ) -> Result<([u8; HEADER_LEN], Vec<OwnedFd>), TransportError> {
        let mut header = [0u8; HEADER_LEN];
        let mut filled = 0;
        let mut descriptors = Vec::new();
        while filled < HEADER_LEN {
            let mut control = RecvAncillaryBuffer::new(space);
            let mut iov = [IoSliceMut::new(&mut header[filled..])];
            let received = match rustix::net::recvmsg(
                &self.stream,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(received) => received,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(self.failed("receiving descriptors", e.into())),
            };
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = message {
                    descriptors.extend(fds);
                }
            }
            if received.flags.contains(ReturnFlags::CTRUNC) {
                return Err(TransportError::Truncated {
                    id,
                    limit: open_file_limit(),
                });
            }
            if received.bytes == 0 {
                return Err(
                    self.failed("receiving descriptors", io::ErrorKind::UnexpectedEof.into())
                );
            }
            filled += received.bytes;
        }
        Ok((header, descriptors))
    }

    /// A batch header's `(count, total)`, after checking it against the descriptors that came with it;
    /// an error frame becomes [`TransportError::Refused`].
    fn parse_header(
        &self,
        id: u64,
        header: &[u8; HEADER_LEN],
        fds: &[OwnedFd],
    ) -> Result<(usize, usize), TransportError> {
        if header[..4] != REPLY_MAGIC {
            return Err(self.protocol(format!(
                "a reply starting {:?}",
                header[..4].escape_ascii().to_string()
            )));
        }
        let [kind, a, b] = [4, 8, 12].map(|at| u32::from_le_bytes(bytes_at(header, at)));
        let (a, b) = (a as usize, b as usize);
        match kind {
            KIND_BATCH if a > BATCH => {
                Err(self.protocol(format!("a batch of {a} descriptors (at most {BATCH})")))
            }
            KIND_BATCH if a != fds.len() => Err(self.protocol(format!(
                "a batch announced {a} descriptors and {} came",
                fds.len()
            ))),
            KIND_BATCH => Ok((a, b)),
            KIND_ERROR if a > MAX_ERROR_TEXT => {
                Err(self.protocol(format!("an error text of {a} bytes")))
            }
            KIND_ERROR => {
                let mut text = vec![0u8; a];
                (&self.stream)
                    .read_exact(&mut text)
                    .map_err(|e| self.failed("reading the exporter's error", e))?;
                Err(TransportError::Refused {
                    id,
                    message: String::from_utf8_lossy(&text).into_owned(),
                })
            }
            _ => Err(self.protocol(format!("a reply of kind {kind}"))),
        }
    }

    fn protocol(&self, detail: String) -> TransportError {
        TransportError::Protocol {
            address: self.address.clone(),
            detail,
        }
    }

    fn failed(&self, doing: &'static str, source: io::Error) -> TransportError {
        let address = self.address.clone();
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                TransportError::Timeout { address, doing }
            }
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe => TransportError::Disconnected { address, doing },
            _ => TransportError::Io {
                doing: format!("{doing} from {address}"),
                source,
            },
        }
    }
}

/// This process's soft limit on open files, for [`TransportError::Truncated`].
fn open_file_limit() -> String {
    match rustix::process::getrlimit(Resource::Nofile).current {
        Some(limit) => limit.to_string(),
        None => "unlimited".into(),
    }
}
