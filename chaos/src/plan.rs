//! The fault schedule: a pure function of the seed and the run's shape, so that a seed replays
//! the same faults at the same offsets against the same processes.

use std::fmt;
use std::time::Duration;

/// SplitMix64: tiny, and its sequence is fixed by its definition, so a seed printed today
/// replays the same schedule with any future version of any dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator for `seed`, on the stream `stream` (the schedule and the producer draw
    /// from different streams, so that changing one leaves the other as it was).
    pub fn new(seed: u64, stream: u64) -> Rng {
        Rng(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1_u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)` (`lo` when the range is empty).
    pub fn below(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo { lo } else { lo + self.next_u64() % (hi - lo) }
    }

    /// A duration uniform in `[lo, hi)`, to the millisecond.
    pub fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        Duration::from_millis(self.below(lo.as_millis() as u64, hi.as_millis() as u64))
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// Which service a network fault is aimed at (through the process's own proxy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// PostgreSQL.
    Db,
    /// RabbitMQ.
    Broker,
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Service::Db => "db",
            Service::Broker => "broker",
        })
    }
}

/// One fault of the schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// SIGKILL, then a new process after the pause.
    Kill,
    /// SIGSTOP for the duration (longer than the lease), then SIGCONT.
    Stop,
    /// SIGTERM (a graceful stop), then a new process after the pause.
    Term,
    /// SIGSTOP for the duration (just past the lease) while every other process's broker link
    /// is slow, then SIGCONT: the process wakes while the rows it held are still in flight at
    /// the processes that took them over, so its late writes meet rows another holds, which
    /// only the fence keeps them from.
    StaleWake,
    /// Every connection to the service closed, and new ones refused, for the duration.
    Cut(Service),
    /// Nothing forwarded for the duration; `downstream_only`: requests still reach the service,
    /// its answers do not come back.
    Blackhole { service: Service, downstream_only: bool },
    /// Every chunk held back this long, both ways.
    Delay { service: Service, latency: Duration },
    /// A grey failure: the connections to the service open at the start of the fault forward
    /// nothing either way and stay open (no FIN, no RST), while new connections pass; thawed at
    /// its end (a frozen VM that resumes).
    Freeze(Service),
    /// A grey failure: the run's queue, capped at [`QUEUE_LIMIT`] messages with
    /// `x-overflow = reject-publish`, fills up because its consumer stops for the duration; the
    /// broker nacks what it cannot take, until the consumer comes back and empties it. Every
    /// process meets it at once.
    FullQueue,
    /// Reads limited to this many bytes a second, both ways.
    Slow { service: Service, bytes_per_second: u32 },
    /// The broker's memory alarm, as `connection.blocked` from the proxy.
    Alarm,
    /// A row the sink rejects permanently: no binding for its routing key.
    PoisonUnroutable,
    /// A row the sink rejects permanently: a producer header name AMQP cannot encode.
    PoisonHeader,
    /// `--cluster`: node `node` of the run's RabbitMQ cluster killed with SIGKILL, started
    /// again after the duration (and back in the cluster before the next node loss).
    NodeLoss {
        /// 1 or 2: node 0 serves the run's consumer and stays.
        node: usize,
    },
}

impl Kind {
    /// Whether the fault is a row rather than something done to a process or its links.
    pub fn is_poison(self) -> bool {
        matches!(self, Kind::PoisonUnroutable | Kind::PoisonHeader)
    }

    /// Whether the fault holds a process's database link (a process that exits 1 at start, or
    /// leaves rows processing after SIGTERM, meanwhile is excused).
    pub fn holds_db(self) -> bool {
        matches!(
            self,
            Kind::Cut(Service::Db) | Kind::Blackhole { service: Service::Db, .. } | Kind::Freeze(Service::Db)
        )
    }

    /// Faults that act on the process itself: at most one at a time per process.
    fn on_process(self) -> bool {
        matches!(self, Kind::Kill | Kind::Stop | Kind::Term | Kind::StaleWake)
    }

    /// The proxy a network fault holds: at most one fault at a time per proxy.
    fn service(self) -> Option<Service> {
        match self {
            Kind::Cut(s) | Kind::Blackhole { service: s, .. } | Kind::Delay { service: s, .. } | Kind::Freeze(s) => {
                Some(s)
            }
            Kind::Slow { service: s, .. } => Some(s),
            Kind::Alarm => Some(Service::Broker),
            _ => None,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::Kill => write!(f, "kill -9"),
            Kind::Stop => write!(f, "SIGSTOP/SIGCONT"),
            Kind::Term => write!(f, "SIGTERM+restart"),
            Kind::StaleWake => write!(f, "stale wake-up"),
            Kind::Cut(s) => write!(f, "cut {s}"),
            Kind::Blackhole { service, downstream_only: false } => write!(f, "blackhole {service}"),
            Kind::Blackhole { service, downstream_only: true } => write!(f, "blackhole {service} replies"),
            Kind::Delay { service, latency } => write!(f, "delay {service} {}ms", latency.as_millis()),
            Kind::Freeze(service) => write!(f, "freeze {service} link"),
            Kind::FullQueue => write!(f, "full queue"),
            Kind::Slow { service, bytes_per_second } => write!(f, "slow {service} {}B/s", bytes_per_second),
            Kind::Alarm => write!(f, "broker alarm"),
            Kind::PoisonUnroutable => write!(f, "poison: unroutable"),
            Kind::PoisonHeader => write!(f, "poison: bad header"),
            Kind::NodeLoss { node } => write!(f, "kill node {node}"),
        }
    }
}

/// A scheduled fault.
#[derive(Debug, Clone)]
pub struct Fault {
    /// Offset from the start of production.
    pub at: Duration,
    /// What happens.
    pub kind: Kind,
    /// The dispatcher process it is aimed at (0-based; unused by poison rows).
    pub process: usize,
    /// How long it lasts (kill and SIGTERM: the pause before the new process).
    pub duration: Duration,
}

/// The settings the schedule and the bounds depend on.
#[derive(Debug, Clone)]
pub struct Shape {
    /// How long rows are produced (and faults start).
    pub run: Duration,
    /// Dispatcher processes.
    pub processes: usize,
    /// `run --lease`.
    pub lease: Duration,
    /// Mean pause between the starts of two faults.
    pub mean_gap: Duration,
    /// Against a three-node cluster: node losses join the menu.
    pub cluster: bool,
}

/// How long a killed node takes to be back in the cluster, at most, on a small machine: no
/// other node loss starts before.
const NODE_BACK: Duration = Duration::from_secs(45);

/// The run's queue holds this many messages at most, and turns the rest away
/// (`x-overflow = reject-publish`): its consumer keeps it near empty, except during a
/// [`Kind::FullQueue`].
pub const QUEUE_LIMIT: i64 = 200;

/// How long a full queue's consumer takes to empty it and be back before another full queue:
/// none starts before.
const QUEUE_BACK: Duration = Duration::from_secs(3);

/// Draws one fault of a kind, and its duration, given the lease.
type Draw = fn(&mut Rng, Duration) -> (Kind, Duration);

/// The schedule for `seed`: faults start at exponential gaps and may overlap, except that a
/// process has one process fault (kill, stop, SIGTERM) at a time and each of its proxies one
/// network fault at a time; every fault ends before production does.
pub fn schedule(seed: u64, shape: &Shape) -> Vec<Fault> {
    let mut rng = Rng::new(seed, 1);
    let lease = shape.lease;
    let secs = Duration::from_secs;
    let ms = Duration::from_millis;
    // Weights: process faults and alarms most often, since they exercise the lease and the
    // blocked-broker protocol, the parts most worth breaking.
    let menu: [(u32, Draw); 14] = [
        (3, |r, lease| (Kind::StaleWake, lease + r.duration(Duration::from_millis(300), Duration::from_millis(500)))),
        (4, |r, _| (Kind::Kill, r.duration(Duration::from_millis(300), Duration::from_secs(3)))),
        (4, |r, lease| (Kind::Stop, lease + r.duration(Duration::from_millis(200), Duration::from_secs(3)))),
        (3, |r, _| (Kind::Term, r.duration(Duration::from_millis(300), Duration::from_secs(2)))),
        (2, |r, _| (Kind::Cut(pick_service(r)), r.duration(Duration::from_secs(1), Duration::from_secs(8)))),
        (2, |r, _| {
            let kind = Kind::Blackhole { service: pick_service(r), downstream_only: r.chance(0.5) };
            (kind, r.duration(Duration::from_secs(1), Duration::from_secs(8)))
        }),
        (2, |r, _| {
            let kind = Kind::Delay {
                service: pick_service(r),
                latency: r.duration(Duration::from_millis(20), Duration::from_millis(300)),
            };
            (kind, r.duration(Duration::from_secs(2), Duration::from_secs(10)))
        }),
        (2, |r, _| {
            let kind = Kind::Slow { service: pick_service(r), bytes_per_second: r.below(4_000, 40_000) as u32 };
            (kind, r.duration(Duration::from_secs(2), Duration::from_secs(10)))
        }),
        (3, |r, _| (Kind::Alarm, r.duration(Duration::from_secs(1), Duration::from_secs(10)))),
        (1, |_, _| (Kind::PoisonUnroutable, Duration::ZERO)),
        (1, |_, _| (Kind::PoisonHeader, Duration::ZERO)),
        // A second SIGSTOP flavour: just past the lease, so that the takeover and the stale
        // process's wake-up race each other.
        (2, |r, lease| (Kind::Stop, lease + r.duration(Duration::from_millis(0), Duration::from_millis(400)))),
        // Grey failures: a database link frozen past the query timeout (5 s), a full queue.
        (2, |r, _| (Kind::Freeze(Service::Db), r.duration(Duration::from_secs(3), Duration::from_secs(12)))),
        (2, |r, _| (Kind::FullQueue, r.duration(Duration::from_secs(2), Duration::from_secs(10)))),
    ];
    // Node losses only against a cluster, drawn after the menu's other faults: a seed without
    // `--cluster` replays the schedule it always did.
    let node_loss: (u32, Draw) = (3, |r, _| {
        let node = 1 + r.below(0, 2) as usize;
        (Kind::NodeLoss { node }, r.duration(Duration::from_millis(500), Duration::from_secs(5)))
    });
    let menu: Vec<(u32, Draw)> = menu.into_iter().chain(shape.cluster.then_some(node_loss)).collect();
    let mut node_busy = Duration::ZERO;
    let mut queue_busy = Duration::ZERO;
    let total: u32 = menu.iter().map(|(w, _)| w).sum();
    // Busy until: per process, and per (process, service) proxy.
    let mut process_busy = vec![Duration::ZERO; shape.processes];
    let mut proxy_busy = vec![[Duration::ZERO; 2]; shape.processes];
    let mut faults = Vec::new();
    // A quiet start, so that every process is up and publishing before the first fault.
    let mut at = secs(3);
    let quiet_end = secs(3).max(lease);
    loop {
        at += Duration::from_secs_f64(-(1.0 - rng.unit()).ln() * shape.mean_gap.as_secs_f64());
        if at + quiet_end >= shape.run {
            break;
        }
        let mut pick = rng.below(0, u64::from(total)) as u32;
        let Some((_, make)) = menu.iter().find(|(w, _)| {
            let hit = pick < *w;
            pick = pick.saturating_sub(*w);
            hit
        }) else {
            continue;
        };
        let (kind, duration) = make(&mut rng, lease);
        let first = rng.below(0, shape.processes as u64) as usize;
        // The first process, in turn from a random one, whose target is free then.
        let free = (0..shape.processes).map(|i| (first + i) % shape.processes).find(|&p| {
            if kind.is_poison() {
                true
            } else if matches!(kind, Kind::NodeLoss { .. }) {
                node_busy <= at
            } else if kind == Kind::FullQueue {
                queue_busy <= at
            } else if kind == Kind::StaleWake {
                process_busy[p] <= at && (0..shape.processes).all(|q| q == p || proxy_busy[q][1] <= at)
            } else if kind.on_process() {
                process_busy[p] <= at
            } else {
                proxy_busy[p][slot(kind.service().unwrap_or(Service::Db))] <= at
            }
        });
        let Some(process) = free else { continue };
        // Kill and SIGTERM last their pause plus the process's own start or stop.
        let busy_until = at + duration + if matches!(kind, Kind::Kill | Kind::Term) { secs(15) } else { ms(500) };
        if at + duration + quiet_end >= shape.run {
            continue;
        }
        if kind == Kind::StaleWake {
            for (q, busy) in proxy_busy.iter_mut().enumerate() {
                if q != process {
                    busy[slot(Service::Broker)] = busy_until + STALE_WAKE_TAIL;
                }
            }
        }
        if matches!(kind, Kind::NodeLoss { .. }) {
            node_busy = at + duration + NODE_BACK;
        } else if kind == Kind::FullQueue {
            queue_busy = at + duration + QUEUE_BACK;
        } else if kind.on_process() {
            process_busy[process] = busy_until;
        } else if let Some(service) = kind.service() {
            proxy_busy[process][slot(service)] = busy_until;
        }
        faults.push(Fault { at, kind, process, duration });
    }
    faults
}

/// A stale wake-up keeps the other processes' broker links slow this long after SIGCONT, so
/// that the rows they took over are still in flight when the woken process writes.
pub const STALE_WAKE_TAIL: Duration = Duration::from_millis(1500);

/// The latency of the other processes' broker links during a stale wake-up: a publish round
/// trip of twice this, well inside the publish timeout.
pub const STALE_WAKE_LATENCY: Duration = Duration::from_millis(250);

fn pick_service(r: &mut Rng) -> Service {
    if r.chance(0.5) { Service::Db } else { Service::Broker }
}

fn slot(service: Service) -> usize {
    match service {
        Service::Db => 0,
        Service::Broker => 1,
    }
}

/// The in-flight window of one process: `workers × max_in_flight`, the most rows it holds
/// claimed (publishing or finalizing) at any instant.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// `run --workers`.
    pub workers: u64,
    /// `run --max-in-flight`.
    pub max_in_flight: u64,
    /// `run --publish-timeout`.
    pub publish_timeout: Duration,
    /// `run --lease`.
    pub lease: Duration,
}

impl Window {
    fn rows(&self) -> u64 {
        self.workers * self.max_in_flight
    }

    /// The duplicates `fault` may cause, from the protocol (docs/chaos.md explains each), among
    /// `processes` processes.
    pub fn bound(&self, fault: &Fault, processes: usize) -> u64 {
        let w = self.rows();
        // Windows that can each be lost once per `period` during `fault.duration`, plus the
        // one in flight when it began.
        let per = |period: Duration| w * (1 + fault.duration.as_millis().div_ceil(period.as_millis().max(1)) as u64);
        match fault.kind {
            // Whatever the process held was maybe published and never finalized.
            Kind::Kill | Kind::Stop => w,
            // The stopped process's window, and each other process's slow link for the stop
            // and its tail.
            Kind::StaleWake => {
                let slow = Fault { duration: fault.duration + STALE_WAKE_TAIL, ..fault.clone() };
                let others =
                    w * (1 + slow.duration.as_millis().div_ceil(self.publish_timeout.as_millis().max(1)) as u64);
                w + others * (processes as u64).saturating_sub(1)
            }
            // A graceful stop finishes and finalizes what it started.
            Kind::Term => 0,
            // Confirms or finalizes lost with the connection, or leases run out meanwhile. A
            // frozen database link is given up at the query timeout; what it held is handed
            // back or finalized on a fresh connection, within the lease as a rule.
            Kind::Cut(_) | Kind::Blackhole { service: Service::Db, .. } | Kind::Freeze(Service::Db) => w,
            // A frozen broker link looks down once it confirmed nothing for its unresponsive
            // time; what it held is published again on a new link.
            Kind::Freeze(Service::Broker) => w,
            // A nacked message is not in the queue: sent again, it arrives once. A channel
            // whose first answer is a nack is replaced (see the sink), and what was in flight on
            // it is published again: one window a process.
            Kind::FullQueue => w * processes as u64,
            // The sink still says it is up until it has heard nothing for its unresponsive
            // time: meanwhile each publish times out and is sent again once per publish
            // timeout, and the proxy delivers every copy it held (or the broker got) when the
            // blackhole ends.
            Kind::Blackhole { service: Service::Broker, .. } => per(self.publish_timeout),
            // A slow link can make publishes time out (then they are sent again), once per
            // publish timeout for a broker link and once per lease for a database link.
            Kind::Delay { service: Service::Broker, .. } | Kind::Slow { service: Service::Broker, .. } => {
                per(self.publish_timeout)
            }
            Kind::Delay { service: Service::Db, .. } | Kind::Slow { service: Service::Db, .. } => per(self.lease),
            // Publishes wait for a blocked broker; they are not timed out and sent again.
            Kind::Alarm => 0,
            Kind::PoisonUnroutable | Kind::PoisonHeader => 0,
            // Every process may have its window in flight to the lost node (its connection,
            // or the queue's leader there): replicated, never confirmed, published again.
            Kind::NodeLoss { .. } => w * processes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            run: Duration::from_secs(120),
            processes: 3,
            lease: Duration::from_secs(2),
            mean_gap: Duration::from_secs(3),
            cluster: false,
        }
    }

    #[test]
    fn a_seed_gives_the_same_schedule_and_another_seed_another() {
        let (a, b, c) = (schedule(7, &shape()), schedule(7, &shape()), schedule(8, &shape()));
        let show = |f: &[Fault]| format!("{f:?}");
        assert_eq!(show(&a), show(&b));
        assert_ne!(show(&a), show(&c));
        assert!(a.len() > 10, "{} faults", a.len());
    }

    #[test]
    fn node_losses_come_only_against_a_cluster_one_at_a_time() {
        let cluster = Shape { cluster: true, ..shape() };
        let mut losses = 0;
        for seed in 0..50 {
            assert!(!schedule(seed, &shape()).iter().any(|f| matches!(f.kind, Kind::NodeLoss { .. })));
            let faults = schedule(seed, &cluster);
            let nodes: Vec<&Fault> = faults.iter().filter(|f| matches!(f.kind, Kind::NodeLoss { .. })).collect();
            for pair in nodes.windows(2) {
                assert!(pair[0].at + pair[0].duration + NODE_BACK <= pair[1].at, "seed {seed}: {pair:?}");
            }
            assert!(nodes.iter().all(|f| matches!(f.kind, Kind::NodeLoss { node: 1 | 2 })), "seed {seed}");
            losses += nodes.len();
        }
        assert!(losses >= 50, "{losses} node losses in 50 schedules");
    }

    #[test]
    fn grey_faults_are_in_the_mix_and_full_queues_come_one_at_a_time() {
        let (mut freezes, mut full) = (0, 0);
        for seed in 0..50 {
            let faults = schedule(seed, &shape());
            freezes += faults.iter().filter(|f| f.kind == Kind::Freeze(Service::Db)).count();
            let queues: Vec<&Fault> = faults.iter().filter(|f| f.kind == Kind::FullQueue).collect();
            for pair in queues.windows(2) {
                assert!(pair[0].at + pair[0].duration + QUEUE_BACK <= pair[1].at, "seed {seed}: {pair:?}");
            }
            full += queues.len();
        }
        assert!(freezes >= 50 && full >= 50, "{freezes} frozen links and {full} full queues in 50 schedules");
    }

    #[test]
    fn no_two_process_faults_of_one_process_overlap_and_all_end_in_time() {
        for seed in 0..50 {
            let faults = schedule(seed, &shape());
            for f in &faults {
                assert!(f.at + f.duration < shape().run, "{f:?}");
            }
            let on = |f: &&Fault| f.kind.on_process();
            for (i, a) in faults.iter().filter(on).enumerate() {
                for b in faults.iter().filter(on).skip(i + 1) {
                    assert!(a.process != b.process || a.at + a.duration < b.at, "seed {seed}: {a:?} and {b:?}");
                }
            }
        }
    }
}
