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

/// What `/proc/<pid>/stat` says of one process: its parent, its own CPU time and that of its
/// children it has waited for (user + system, in ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessTicks {
    pub(crate) parent: u32,
    pub(crate) own: u64,
    pub(crate) reaped_children: u64,
}

impl ProcessTicks {
    /// The process `pid`, `None` when it is gone (or off Linux).
    pub(crate) fn read(pid: u32) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    fn parse(stat: &str) -> Option<Self> {
        let (_, rest) = stat.rsplit_once(')')?;
        // After the name: state, ppid (field 4), ... utime, stime (14, 15), cutime, cstime (16, 17).
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| fields.get(i)?.parse::<u64>().ok();
        Some(Self {
            parent: u32::try_from(field(1)?).ok()?,
            own: field(11)? + field(12)?,
            reaped_children: field(13)? + field(14)?,
        })
    }

    /// Ticks in seconds.
    pub(crate) fn seconds(ticks: u64) -> f64 {
        ticks as f64 / USER_HZ
    }
}

/// The pids of the processes `pid` started that are still there (its main thread's
/// `children`); empty when it is gone (or off Linux).
pub(crate) fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|s| s.split_whitespace().filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

/// The command line of `pid` as it shows it (PostgreSQL's processes show their role there),
/// arguments joined by spaces.
pub(crate) fn command_line(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " ").trim().to_owned())
        .unwrap_or_default()
}

/// `VmRSS` (resident set now) of the process `pid`, in KiB; 0 when it is gone (or off Linux).
pub(crate) fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time (user + system) this process has used so far, in seconds.
pub(crate) fn own_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    Some(process_cpu_ticks(&stat)?.1 as f64 / USER_HZ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_parent_own_and_reaped_ticks() {
        // A name with a space and a parenthesis; utime 120, stime 30, cutime 500, cstime 70.
        let stat = "4242 (postgres: a (b)) S 77 4242 4242 0 -1 4194560 1 0 0 0 120 30 500 70 20 0 1 0 5 6 7";
        assert_eq!(ProcessTicks::parse(stat), Some(ProcessTicks { parent: 77, own: 150, reaped_children: 570 }));
        assert_eq!(process_cpu_ticks(stat), Some(("postgres: a (b)", 150)));
    }
}
