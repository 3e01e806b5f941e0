//! Where a PostgreSQL server's CPU goes, by role: the relay's backends, the producers', the
//! bench's own, autovacuum, the server's other background processes and everyone else.
//!
//! The server is the one the bench's sampling connection reaches (on this machine: its
//! backend's parent is the postmaster). Every [`SAMPLE`](super::steady::SAMPLE) the children of
//! the postmaster are read from `/proc` (CPU ticks), and each new one is given its role once, from
//! `pg_stat_activity` (database, `application_name`, `backend_type`, a parallel worker's
//! leader) or its process title. A process that ends between two samples is not lost: the
//! postmaster reaps its children, so their whole CPU time lands in its `cutime` and `cstime`;
//! what that counter gained beyond what the samples saw of the processes that ended is the
//! `exited` share (autovacuum workers, mostly, which often live less than a sample).

use std::collections::HashMap;

use diesel::sql_types::{Array, Int4, Nullable, Text};
use diesel_async::RunQueryDsl;
use serde::Serialize;

use super::bench_conn::{BENCH_APP, BenchConn, PRODUCER_APP};
use crate::BoxError;
use crate::procstat::{ProcessTicks, children, command_line};

/// What a server process does, as far as the meters care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// A backend of the bench's database that is neither the producers' nor the bench's.
    Relay,
    Producers,
    /// The bench's sampling, holding and bookkeeping connections.
    Bench,
    /// The autovacuum launcher and workers.
    Autovacuum,
    /// The postmaster, checkpointer, background writer, WAL writer and the like.
    Background,
    /// Backends of other databases (other users of a shared server).
    Others,
}

/// CPU seconds by role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(super) struct RoleSeconds {
    pub(super) relay: f64,
    pub(super) producers: f64,
    pub(super) bench: f64,
    pub(super) autovacuum: f64,
    pub(super) background: f64,
    pub(super) others: f64,
    /// Processes that ended: what they spent after their last sample (or, born and gone
    /// between two samples, all of it).
    pub(super) exited: f64,
}

impl RoleSeconds {
    /// The whole server's.
    pub(super) fn total(&self) -> f64 {
        self.relay + self.producers + self.bench + self.autovacuum + self.background + self.others + self.exited
    }

    /// Every role's seconds since `earlier`.
    pub(super) fn since(&self, earlier: &Self) -> Self {
        Self {
            relay: self.relay - earlier.relay,
            producers: self.producers - earlier.producers,
            bench: self.bench - earlier.bench,
            autovacuum: self.autovacuum - earlier.autovacuum,
            background: self.background - earlier.background,
            others: self.others - earlier.others,
            exited: self.exited - earlier.exited,
        }
    }

    /// Every role's seconds multiplied by `factor` (e.g. into microseconds per message).
    pub(super) fn scaled(&self, factor: f64) -> Self {
        Self {
            relay: self.relay * factor,
            producers: self.producers * factor,
            bench: self.bench * factor,
            autovacuum: self.autovacuum * factor,
            background: self.background * factor,
            others: self.others * factor,
            exited: self.exited * factor,
        }
    }

    fn add(&mut self, role: Role, seconds: f64) {
        *match role {
            Role::Relay => &mut self.relay,
            Role::Producers => &mut self.producers,
            Role::Bench => &mut self.bench,
            Role::Autovacuum => &mut self.autovacuum,
            Role::Background => &mut self.background,
            Role::Others => &mut self.others,
        } += seconds;
    }
}

/// One child of the postmaster, as the samples saw it.
#[derive(Debug)]
struct Account {
    role: Option<Role>,
    /// Its ticks when the accounts began (0 for a process born since).
    base: u64,
    /// Its ticks at the last sample that saw it.
    last: u64,
    alive: bool,
    /// Samples in which `pg_stat_activity` did not know it yet.
    misses: u32,
}

/// The bookkeeping of [`PgProcs`], apart from `/proc` and the database.
#[derive(Debug)]
struct Accounts {
    accounts: HashMap<u32, Account>,
    /// The postmaster's own ticks, and its reaped children's, when the accounts began and at
    /// the last sample.
    own_base: u64,
    reaped_base: u64,
    own: u64,
    reaped: u64,
    /// The base ticks of the processes that were there at the start and have ended since (their
    /// whole life is in `reaped`).
    ended_base: u64,
}

impl Accounts {
    fn begin(own: u64, reaped: u64, children: &[(u32, u64)]) -> Self {
        let accounts = children
            .iter()
            .map(|&(pid, ticks)| (pid, Account { role: None, base: ticks, last: ticks, alive: true, misses: 0 }))
            .collect();
        Self { accounts, own_base: own, reaped_base: reaped, own, reaped, ended_base: 0 }
    }

    /// A sample: the postmaster's ticks, then its children's (read in that order, so that a
    /// child reaped in between is missed for one sample rather than counted twice).
    fn update(&mut self, own: u64, reaped: u64, children: &[(u32, u64)]) {
        self.own = own;
        self.reaped = reaped;
        let now: HashMap<u32, u64> = children.iter().copied().collect();
        for (pid, account) in &mut self.accounts {
            match now.get(pid) {
                Some(&ticks) => account.last = ticks,
                None if account.alive => {
                    account.alive = false;
                    self.ended_base += account.base;
                }
                None => {}
            }
        }
        for (&pid, &ticks) in &now {
            self.accounts.entry(pid).or_insert(Account { role: None, base: 0, last: ticks, alive: true, misses: 0 });
        }
    }

    /// Living processes that have no role yet.
    fn unclassified(&self) -> Vec<u32> {
        self.accounts.iter().filter(|(_, a)| a.alive && a.role.is_none()).map(|(pid, _)| *pid).collect()
    }

    /// CPU seconds by role from the beginning to the last sample.
    fn so_far(&self) -> RoleSeconds {
        let mut seconds = RoleSeconds::default();
        let mut seen_of_ended = 0;
        for account in self.accounts.values() {
            let spent = account.last.saturating_sub(account.base);
            seconds.add(account.role.unwrap_or(Role::Others), ProcessTicks::seconds(spent));
            if !account.alive {
                seen_of_ended += spent;
            }
        }
        seconds.add(Role::Background, ProcessTicks::seconds(self.own.saturating_sub(self.own_base)));
        let reaped = self.reaped.saturating_sub(self.reaped_base);
        seconds.exited = ProcessTicks::seconds(reaped.saturating_sub(self.ended_base + seen_of_ended));
        seconds
    }
}

/// The processes of the server the bench's sampling connection reaches.
pub(super) struct PgProcs {
    postmaster: u32,
    database: String,
    accounts: Accounts,
}

/// How many samples a process may be missing from `pg_stat_activity` (a backend still
/// authenticating) before its title decides its role.
const MISSES: u32 = 8;

impl PgProcs {
    /// Begins the accounts of the server `conn` reaches, whose database `database` is the
    /// bench's; `None` when that server is not a process of this machine.
    pub(super) async fn begin(conn: &mut BenchConn, database: &str) -> Result<Option<Self>, BoxError> {
        #[derive(diesel::QueryableByName)]
        struct Pid {
            #[diesel(sql_type = Int4)]
            pid: i32,
        }
        let me: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid").get_result(conn.one()).await?;
        let Some(postmaster) = u32::try_from(me.pid).ok().and_then(ProcessTicks::read).map(|t| t.parent) else {
            return Ok(None);
        };
        if !command_line(postmaster).contains("postgres") {
            return Ok(None);
        }
        let Some(ticks) = ProcessTicks::read(postmaster) else { return Ok(None) };
        let mut procs = Self {
            postmaster,
            database: database.to_owned(),
            accounts: Accounts::begin(ticks.own, ticks.reaped_children, &children_ticks(postmaster)),
        };
        procs.classify(conn).await?;
        Ok(Some(procs))
    }

    /// Reads every process again and gives the new ones their role.
    pub(super) async fn sample(&mut self, conn: &mut BenchConn) -> Result<(), BoxError> {
        let postmaster = self.postmaster;
        // Off the bench's thread, so that its consumer keeps noting arrivals meanwhile.
        let read =
            tokio::task::spawn_blocking(move || Some((ProcessTicks::read(postmaster)?, children_ticks(postmaster))));
        let Some((ticks, children)) = read.await? else {
            return Err("the PostgreSQL server's postmaster is gone".into());
        };
        self.accounts.update(ticks.own, ticks.reaped_children, &children);
        self.classify(conn).await
    }

    /// CPU seconds by role from [`PgProcs::begin`] to the last sample.
    pub(super) fn so_far(&self) -> RoleSeconds {
        self.accounts.so_far()
    }

    async fn classify(&mut self, conn: &mut BenchConn) -> Result<(), BoxError> {
        let pids = self.accounts.unclassified();
        if pids.is_empty() {
            return Ok(());
        }
        #[derive(diesel::QueryableByName)]
        struct Activity {
            #[diesel(sql_type = Int4)]
            pid: i32,
            #[diesel(sql_type = Text)]
            backend_type: String,
            #[diesel(sql_type = Text)]
            datname: String,
            #[diesel(sql_type = Text)]
            app: String,
            #[diesel(sql_type = Nullable<Int4>)]
            leader_pid: Option<i32>,
        }
        let wanted: Vec<i32> = pids.iter().filter_map(|p| i32::try_from(*p).ok()).collect();
        let rows: Vec<Activity> = diesel::sql_query(
            "SELECT pid, coalesce(backend_type, '') AS backend_type, coalesce(datname::text, '') AS datname,
                    coalesce(application_name, '') AS app, leader_pid
             FROM pg_stat_activity WHERE pid = ANY($1)",
        )
        .bind::<Array<Int4>, _>(&wanted)
        .get_results(conn.one())
        .await?;
        let found: HashMap<u32, Activity> = rows.into_iter().map(|r| (r.pid as u32, r)).collect();
        for pid in pids {
            let role = match found.get(&pid) {
                Some(a) => {
                    let leader = a.leader_pid.and_then(|l| self.accounts.accounts.get(&(l as u32))?.role);
                    Some(role_of(&a.backend_type, &a.datname, &a.app, &self.database, leader))
                }
                None => None,
            };
            let Some(account) = self.accounts.accounts.get_mut(&pid) else { continue };
            account.role = match role {
                Some(role) => Some(role),
                None => {
                    account.misses += 1;
                    (account.misses >= MISSES).then(|| title_role(&command_line(pid)))
                }
            };
        }
        Ok(())
    }
}

/// The CPU ticks of every child of `postmaster` still there.
fn children_ticks(postmaster: u32) -> Vec<(u32, u64)> {
    children(postmaster).into_iter().filter_map(|pid| Some((pid, ProcessTicks::read(pid)?.own))).collect()
}

/// The role of a process `pg_stat_activity` knows.
fn role_of(backend_type: &str, datname: &str, app: &str, database: &str, leader: Option<Role>) -> Role {
    match backend_type {
        "client backend" if datname != database => Role::Others,
        "client backend" if app == PRODUCER_APP => Role::Producers,
        "client backend" if app.starts_with(BENCH_APP) => Role::Bench,
        "client backend" => Role::Relay,
        "autovacuum worker" | "autovacuum launcher" => Role::Autovacuum,
        "parallel worker" => leader.unwrap_or(Role::Others),
        _ => Role::Background,
    }
}

/// The role of a process `pg_stat_activity` does not show, from its title.
fn title_role(title: &str) -> Role {
    if title.contains("autovacuum") { Role::Autovacuum } else { Role::Background }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seconds(ticks: u64) -> f64 {
        ProcessTicks::seconds(ticks)
    }

    #[test]
    fn every_tick_of_the_window_is_counted_once_with_its_role() {
        // At the start: a relay backend (100 ticks so far), an autovacuum worker (40) and the
        // checkpointer (7); the postmaster has spent 5 itself and reaped 1,000 of children.
        let mut accounts = Accounts::begin(5, 1_000, &[(10, 100), (11, 40), (12, 7)]);
        accounts.accounts.get_mut(&10).unwrap().role = Some(Role::Relay);
        accounts.accounts.get_mut(&11).unwrap().role = Some(Role::Autovacuum);
        accounts.accounts.get_mut(&12).unwrap().role = Some(Role::Background);
        // A sample: the relay +30, the worker +5, a producer born (3 ticks so far).
        accounts.update(6, 1_000, &[(10, 130), (11, 45), (12, 7), (13, 3)]);
        assert_eq!(accounts.unclassified(), vec![13]);
        accounts.accounts.get_mut(&13).unwrap().role = Some(Role::Producers);
        // The worker ends at 48 ticks (3 after its last sample); a worker born after that
        // sample ends at 20 ticks before the next one; the postmaster reaped both.
        accounts.update(6, 1_000 + 48 + 20, &[(10, 150), (12, 8), (13, 9)]);
        let so_far = accounts.so_far();
        assert_eq!(
            so_far,
            RoleSeconds {
                relay: seconds(50),
                producers: seconds(9),
                bench: 0.0,
                autovacuum: seconds(5),
                background: seconds(1 + 1),
                others: 0.0,
                exited: seconds(3 + 20),
            }
        );
        // The whole: 50 + 9 + (48 - 40) + 1 + 1 + 20 ticks.
        assert!((so_far.total() - seconds(89)).abs() < 1e-9);
        let later = RoleSeconds { relay: seconds(80), ..so_far };
        assert!((later.since(&so_far).relay - seconds(30)).abs() < 1e-9);
    }

    #[test]
    fn backends_are_told_apart_by_database_and_name() {
        let db = "bench_1";
        assert_eq!(role_of("client backend", db, "actix-outbox", db, None), Role::Relay);
        assert_eq!(role_of("client backend", db, "", db, None), Role::Relay);
        assert_eq!(role_of("client backend", db, PRODUCER_APP, db, None), Role::Producers);
        assert_eq!(role_of("client backend", db, "outbox-bench-sampler", db, None), Role::Bench);
        assert_eq!(role_of("client backend", "other", "actix-outbox", db, None), Role::Others);
        assert_eq!(role_of("autovacuum worker", db, "", db, None), Role::Autovacuum);
        assert_eq!(role_of("parallel worker", db, "", db, Some(Role::Relay)), Role::Relay);
        assert_eq!(role_of("checkpointer", "", "", db, None), Role::Background);
        assert_eq!(title_role("postgres: autovacuum worker bench_1"), Role::Autovacuum);
        assert_eq!(title_role("postgres: logger"), Role::Background);
    }
}
