//! What `/proc` says about CPU time and memory: of the whole machine, of the database and
//! broker servers, and of this process. Every reader returns nothing (or zero) off Linux, so
//! the report shows `-` there rather than failing.

use std::collections::HashMap;

/// Busy CPU time of the whole machine so far (every core, every process: `/proc/stat` minus
/// idle and iowait), in seconds; `None` off Linux. Read at both ends of a phase, it says how
/// much CPU the phase cost, whoever spent it (PostgreSQL, RabbitMQ, the dispatcher, the
/// consumer, and anything else running on the machine meanwhile).
pub(crate) fn machine_busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|t| t.parse().ok()).collect();
    let (idle, iowait) = (*ticks.get(3)?, *ticks.get(4)?);
    Some((ticks.iter().sum::<u64>() - idle - iowait) as f64 / USER_HZ)
}

/// The unit of the CPU times in `/proc`: 100 ticks a second on every Linux that matters.
const USER_HZ: f64 = 100.0;

/// The name and the CPU time so far (user + system, in ticks) of the process whose
/// `/proc/<pid>/stat` line is `stat`.
fn process_cpu_ticks(stat: &str) -> Option<(&str, u64)> {
    // `pid (name) state ...`: a name may hold spaces, so it ends at the last parenthesis.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    // utime and stime are the 14th and 15th fields, the 12th and 13th after the name.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some((name, fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?))
}

/// The database and broker servers whose CPU the report shows on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Server {
    Postgres,
    Rabbitmq,
}

/// CPU ticks so far of every PostgreSQL (`postgres`) and RabbitMQ (`beam.smp`) process on the
/// machine, by pid; empty off Linux.
pub(crate) struct ServerTicks(HashMap<u32, (Server, u64)>);

impl ServerTicks {
    pub(crate) fn read() -> Self {
        let mut ticks = HashMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            let Some((name, cpu)) = process_cpu_ticks(&stat) else { continue };
            let server = match name {
                "postgres" => Server::Postgres,
                "beam.smp" => Server::Rabbitmq,
                _ => continue,
            };
            ticks.insert(pid, (server, cpu));
        }
        Self(ticks)
    }

    /// CPU seconds `server` spent since `self` was read: of the processes alive now, what each
    /// spent since then (all of it for one started since). A process that exited in between
    /// is missed; the dispatchers' connections are all open before a phase's clock starts.
    pub(crate) fn spent_since(&self, now: &Self, server: Server) -> f64 {
        let ticks: u64 = now
            .0
            .iter()
            .filter(|(_, (s, _))| *s == server)
            .map(|(pid, (_, t))| t.saturating_sub(self.0.get(pid).map_or(0, |(_, before)| *before)))
            .sum();
        ticks as f64 / USER_HZ
    }
}

/// `VmHWM` (peak resident set) of this process, in KiB.
pub(crate) fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time (user + system) the process `pid` has used so far, in seconds; `None` when it is
/// gone (or off Linux).
pub(crate) fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(process_cpu_ticks(&stat)?.1 as f64 / USER_HZ)
}

/// CPU time (user + system) this process has used so far, in seconds.
pub(crate) fn own_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    Some(process_cpu_ticks(&stat)?.1 as f64 / USER_HZ)
}
