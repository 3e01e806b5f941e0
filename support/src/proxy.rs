//! A TCP proxy in front of RabbitMQ or PostgreSQL that one test (or one dispatcher of the chaos
//! run) owns, so that it can cut, stall, refuse, delay, slow or freeze its own connections, and
//! play the broker's memory alarm, without disturbing the real services or anyone else using
//! them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does right now. Every connection task watches it.
#[derive(Debug, Clone, Copy, Default)]
struct Mode {
    /// Connections accepted before the last `sever()` belong to an older generation and close.
    generation: u64,
    /// Client -> broker bytes are held back (not read from the client).
    stall_up: bool,
    /// Broker -> client bytes are held back.
    stall_down: bool,
    /// New connections are accepted and closed at once (the broker looks down).
    refuse: bool,
    /// AMQP only: the broker has "blocked" every connection (as under a resource alarm): the
    /// proxy sends `connection.blocked` to the client at the next frame boundary and stops
    /// reading the client's bytes, as RabbitMQ does; lifting it sends `connection.unblocked`.
    amqp_blocked: bool,
    /// Every chunk read is written on this much later, in both directions (a long link).
    delay: Duration,
    /// Bytes a second the proxy reads from either side at most (a slow link), if set.
    slow: Option<u32>,
    /// Connections accepted before this one (by their number, from 0) forward nothing either
    /// way and stay open: a frozen peer, a NAT or load balancer that dropped their state. The
    /// proxy's kernel still acknowledges what the client sends, as a live peer's would.
    frozen_below: u64,
}

/// How often a slowed connection reads; each read takes at most a tenth of the rate.
const SLOW_TICK: Duration = Duration::from_millis(100);

/// Forwards every connection accepted on `127.0.0.1:<port>` to `upstream`.
///
/// Faults are set by the methods below and apply at once to every open connection and to the
/// ones accepted later; [`Proxy::heal`] ends them all. Dropping the proxy closes its listener
/// and every connection.
pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    accept: JoinHandle<()>,
    /// Connections accepted so far, which numbers them.
    accepted: Arc<AtomicU64>,
}

impl Proxy {
    /// Listens on a free port of `127.0.0.1` and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::default());
        let modes = mode.clone();
        let accepted = Arc::new(AtomicU64::new(0));
        let counter = accepted.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let now = *modes.borrow();
                if now.refuse {
                    drop(client);
                    continue;
                }
                let Ok(broker) = TcpStream::connect(&upstream).await else { continue };
                let number = counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(forward(client, broker, modes.subscribe(), Link { generation: now.generation, number }));
            }
        });
        Proxy { addr, mode, accept, accepted }
    }

    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `url` with its host and port replaced by the proxy's (`scheme://user@host:port/path`).
    pub fn route(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("url has a scheme");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let user = authority.rsplit_once('@').map_or(String::new(), |(user, _)| format!("{user}@"));
        format!("{scheme}://{user}{}/{path}", self.addr)
    }

    /// `amqp://guest:guest@<proxy address>/%2f`.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// Closes every open connection, both ways (new ones are still accepted unless refused).
    pub fn sever(&self) {
        self.mode.send_modify(|m| m.generation += 1);
    }

    /// Accepts and closes new connections at once while `refuse` is true.
    pub fn refuse(&self, refuse: bool) {
        self.mode.send_modify(|m| m.refuse = refuse);
    }

    /// Stops forwarding in both directions: the broker looks alive but silent.
    pub fn stall(&self) {
        self.mode.send_modify(|m| (m.stall_up, m.stall_down) = (true, true));
    }

    /// Stops forwarding broker -> client only: publishes reach the broker, its confirms do not
    /// come back.
    pub fn stall_downstream(&self) {
        self.mode.send_modify(|m| m.stall_down = true);
    }

    /// Forwards both directions again, releasing whatever was held back.
    pub fn resume(&self) {
        self.mode.send_modify(|m| (m.stall_up, m.stall_down) = (false, false));
    }

    /// A blackhole: connections stay open (and new ones are accepted) but nothing goes through
    /// either way, as behind a dead router; what was sent meanwhile is delivered on
    /// [`Proxy::resume`] unless the connection was closed first. The same as [`Proxy::stall`].
    pub fn blackhole(&self) {
        self.stall();
    }

    /// Delays every chunk by `delay` in both directions (`Duration::ZERO` ends it).
    pub fn delay(&self, delay: Duration) {
        self.mode.send_modify(|m| m.delay = delay);
    }

    /// Reads at most `bytes_per_second` from either side (`None` ends it): the peer's writes
    /// back up as on a congested link.
    pub fn slow_reads(&self, bytes_per_second: Option<u32>) {
        self.mode.send_modify(|m| m.slow = bytes_per_second.map(|b| b.max(10)));
    }

    /// Freezes every connection open now: nothing is forwarded on them either way, and they
    /// stay open (no FIN, no RST), while connections accepted later pass normally. What a
    /// frozen VM, a storage stall or a NAT that dropped its state looks like from the client:
    /// the peer's kernel still acknowledges bytes, so TCP keepalives and a user timeout see a
    /// live link, and only a deadline on the answer notices. [`Proxy::thaw`] (or
    /// [`Proxy::heal`]) forwards on them again, as the VM that resumes.
    pub fn freeze(&self) {
        let below = self.accepted.load(Ordering::SeqCst);
        self.mode.send_modify(|m| m.frozen_below = below);
    }

    /// Ends [`Proxy::freeze`]: the frozen connections that are still open forward again.
    pub fn thaw(&self) {
        self.mode.send_modify(|m| m.frozen_below = 0);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Ends every fault at once: forwards, accepts, unblocks, thaws, no delay, full speed. Open
    /// connections stay open.
    pub fn heal(&self) {
        self.mode.send_modify(|m| *m = Mode { generation: m.generation, ..Mode::default() });
    }

    /// Behaves like a RabbitMQ under a memory alarm towards every AMQP connection through it:
    /// `connection.blocked` to the client, and the client's bytes left unread, until
    /// [`Proxy::amqp_unblock`].
    pub fn amqp_block(&self) {
        self.mode.send_modify(|m| m.amqp_blocked = true);
    }

    /// Ends [`Proxy::amqp_block`]: `connection.unblocked`, and the held bytes flow on.
    pub fn amqp_unblock(&self) {
        self.mode.send_modify(|m| m.amqp_blocked = false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Connection tasks end when they see the mode channel close.
    }
}

/// Which connection a pipe belongs to.
#[derive(Debug, Clone, Copy)]
struct Link {
    /// The `sever()` generation it was accepted in.
    generation: u64,
    /// Its number, in order of acceptance (for `freeze()`).
    number: u64,
}

async fn forward(client: TcpStream, broker: TcpStream, mode: watch::Receiver<Mode>, link: Link) {
    let _ = client.set_nodelay(true);
    let _ = broker.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (broker_read, broker_write) = broker.into_split();
    // Whichever direction ends first closes both sockets.
    tokio::select! {
        () = pipe(client_read, broker_write, mode.clone(), link, |m| m.stall_up || m.amqp_blocked, None) => {}
        () = pipe(broker_read, client_write, mode, link, |m| m.stall_down, Some(Frames::default())) => {}
    }
}

/// Where the broker -> client stream stands in AMQP frames (type, channel, size, payload, end
/// byte), so that a method frame can be slipped in between two frames.
#[derive(Default)]
struct Frames {
    /// Bytes of a frame header seen so far (at most 7).
    header: Vec<u8>,
    /// Bytes of the current frame's payload and end byte still to come.
    rest: usize,
    /// Whether the client has been told it is blocked.
    told_blocked: bool,
}

impl Frames {
    fn at_boundary(&self) -> bool {
        self.header.is_empty() && self.rest == 0
    }

    /// Follows `bytes` through the frame structure.
    fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.rest > 0 {
                let n = self.rest.min(bytes.len());
                self.rest -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (7 - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() == 7 {
                let size = u32::from_be_bytes([self.header[3], self.header[4], self.header[5], self.header[6]]);
                self.rest = size as usize + 1;
                self.header.clear();
            }
        }
    }

    /// Whether the client must be told of a change of the blocked state.
    fn owes_notice(&self, blocked: bool) -> bool {
        blocked != self.told_blocked
    }

    /// Bytes to forward before the stream is between two frames (the header's missing bytes
    /// first, then the payload's).
    fn to_boundary(&self) -> usize {
        if self.header.is_empty() { self.rest } else { 7 - self.header.len() }
    }

    /// The notice frame, marking it told.
    fn notice(&mut self, blocked: bool) -> Vec<u8> {
        self.told_blocked = blocked;
        // connection.blocked (class 10, method 60, reason) / connection.unblocked (10, 61).
        let mut payload = vec![0, 10, 0, if blocked { 60 } else { 61 }];
        if blocked {
            let reason = b"low on memory (test proxy)";
            payload.push(reason.len() as u8);
            payload.extend_from_slice(reason);
        }
        let mut frame = vec![1, 0, 0];
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(&payload);
        frame.push(0xCE);
        frame
    }
}

async fn pipe(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    link: Link,
    stalled: fn(&Mode) -> bool,
    mut frames: Option<Frames>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let now = *mode.borrow_and_update();
        if now.generation != link.generation {
            return;
        }
        if link.number < now.frozen_below {
            // Frozen: not a byte either way, not even a blocked notice, until thawed.
            if mode.changed().await.is_err() {
                return;
            }
            continue;
        }
        if let Some(f) = frames.as_mut()
            && f.owes_notice(now.amqp_blocked)
        {
            if f.at_boundary() {
                if to.write_all(&f.notice(now.amqp_blocked)).await.is_err() {
                    return;
                }
            } else {
                // Finish the frame under way (even while stalled: it is half sent already), so
                // that the notice goes in between two frames.
                let want = f.to_boundary().min(buf.len());
                match from.read(&mut buf[..want]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        f.advance(&buf[..n]);
                        if to.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
                continue;
            }
        }
        if stalled(&now) {
            if mode.changed().await.is_err() {
                return;
            }
            continue;
        }
        // A slowed link reads a tenth of its rate a tick; the sleep after the write paces it.
        let want = now.slow.map_or(buf.len(), |rate| ((rate / 10) as usize).clamp(1, buf.len()));
        tokio::select! {
            read = from.read(&mut buf[..want]) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let read_at = tokio::time::Instant::now();
                    if let Some(frames) = frames.as_mut() {
                        frames.advance(&buf[..n]);
                    }
                    // Not reading meanwhile keeps the bytes in order; whatever waits in the
                    // socket is delayed further, as on a link that is long and busy.
                    if !now.delay.is_zero() {
                        tokio::time::sleep_until(read_at + now.delay).await;
                    }
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                    if now.slow.is_some() {
                        tokio::time::sleep_until(read_at + SLOW_TICK).await;
                    }
                }
            },
            changed = mode.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}
