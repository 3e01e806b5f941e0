//! A three-node RabbitMQ cluster of the test's own, to kill, stop and restart nodes under a
//! running dispatcher: the broker as production runs it when it must survive the loss of a
//! node. The shared test broker (`rabbit@localhost`, port 5672) is never touched.
//!
//! Each node is a `rabbitmq-server -detached` of Debian's `rabbitmq-server` package (run from
//! `/usr/lib/rabbitmq/bin` as the `rabbitmq` user), named `ao<pid>x<n>_<i>@localhost`, on free
//! ports of its own for AMQP and Erlang distribution, with its database, log, plugins file (no
//! plugin) and configuration in a folder of the cluster's own. Every node runs on one Erlang
//! scheduler (`+S 1:1`): three nodes share a small machine with everything else. They share the
//! `rabbitmq` user's Erlang cookie (that of the shared broker too: the node names keep them
//! apart). Starting a cluster takes half a minute or more, most of it RabbitMQ's boot.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::process::{OwnedDir, free_port, run, run_blocking};

/// The user the nodes run as, who owns their folders (and the Erlang cookie in its home).
const RUN_AS: &str = "rabbitmq";
/// Its home, holding the `.erlang.cookie` the nodes and the command line tools share.
const HOME: &str = "/var/lib/rabbitmq";
/// Debian's RabbitMQ programs, called directly rather than through the `/usr/sbin` wrappers
/// (which `su` to the user and, for the server, write to `/var/log/rabbitmq`).
const BIN: &str = "/usr/lib/rabbitmq/bin";
/// The nodes in a cluster.
pub const NODES: usize = 3;
/// How long a node has to boot (or a command line tool to answer).
const WITHIN: Duration = Duration::from_secs(180);

/// Settings of every node: its own listener on 127.0.0.1, and less bookkeeping (no management
/// plugin reads it).
const SETTINGS: &str = "\
collect_statistics_interval = 60000
";

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// One node of the cluster.
#[derive(Clone)]
struct Node {
    /// `ao<pid>x<n>_<i>@localhost`.
    name: String,
    /// The AMQP port, on 127.0.0.1.
    port: u16,
    /// Erlang distribution's port.
    dist: u16,
    /// The node's own folder: `mnesia/`, `log/`, `plugins`, `rabbitmq.conf`, `out`.
    base: PathBuf,
}

impl Node {
    fn pid_file(&self) -> PathBuf {
        self.base.join("mnesia").join(format!("{}.pid", self.name))
    }

    /// The node's Erlang VM, by its pid file, if that pid still runs that node.
    fn pid(&self) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.pid_file()).ok()?.trim().parse().ok()?;
        runs_node(pid, &self.name).then_some(pid)
    }

    /// `rabbitmq-server -detached` for this node. Its output goes to a file: a detached node
    /// whose stdout is a pipe that is then closed dies.
    fn server(&self) -> Command {
        let out = std::fs::File::create(self.base.join("out")).expect("create the node's out file");
        let err = out.try_clone().unwrap();
        let mut command = Command::new("runuser");
        command
            .args(["-u", RUN_AS, "--", &format!("{BIN}/rabbitmq-server"), "-detached"])
            .current_dir(&self.base)
            .env("HOME", HOME)
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", self.base.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.base.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", self.base.join("plugins"))
            .env("RABBITMQ_CONFIG_FILE", self.base.join("rabbitmq.conf"))
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "+S 1:1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        command
    }

    /// Starts the node's VM (detached) and waits until RabbitMQ runs on it.
    fn boot(&self) {
        run(self.server()).unwrap_or_else(|e| panic!("start {}: {e}\n{}", self.name, self.log_tail()));
    }

    /// Waits until the node answers `ping` (it is registered), then until RabbitMQ has booted
    /// on it (`await_startup`, which fails on a node not yet registered).
    fn wait_running(&self) {
        let deadline = Instant::now() + WITHIN;
        while ctl(&self.base, &self.name, &["ping"]).is_err() {
            assert!(Instant::now() < deadline, "{} did not answer within {WITHIN:?}\n{}", self.name, self.log_tail());
            std::thread::sleep(Duration::from_millis(300));
        }
        ctl(&self.base, &self.name, &["await_startup", "--timeout", "180"])
            .unwrap_or_else(|e| panic!("{} did not boot: {e}\n{}", self.name, self.log_tail()));
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.base.join("log").join(format!("{}.log", self.name)))
            .or_else(|_| std::fs::read_to_string(self.base.join("out")))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// Whether process `pid` is the Erlang VM of node `name`. RabbitMQ 3.10 passes the node name
/// to its VM in the environment (`RABBITMQ_NODENAME`), not among the arguments.
fn runs_node(pid: u32, name: &str) -> bool {
    let wanted = format!("RABBITMQ_NODENAME={name}");
    let is_vm = std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "beam.smp");
    is_vm
        && std::fs::read(format!("/proc/{pid}/environ"))
            .map(|environ| environ.split(|b| *b == 0).any(|var| var == wanted.as_bytes()))
            .unwrap_or(false)
}

/// Every process that runs node `name`, found by its environment (a node that had not yet
/// written its pid file when the test failed).
fn pids_of(name: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| runs_node(*pid, name))
        .collect()
}

/// SIGKILL to `pid`, then waits until it is gone (reaped by init: a detached node is nobody's
/// child here).
fn kill_pid(pid: u32, name: &str) {
    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while runs_node(pid, name) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `rabbitmqctl -n <node> args...` as the `rabbitmq` user, bounded in time.
fn ctl(cwd: &Path, node: &str, args: &[&str]) -> Result<String, String> {
    tool(cwd, "rabbitmqctl", node, args)
}

/// One of RabbitMQ's command line tools, `-n <node> args...`; its output if it succeeded.
fn tool(cwd: &Path, program: &str, node: &str, args: &[&str]) -> Result<String, String> {
    run(tool_command(cwd, program, node, args)).map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn tool_command(cwd: &Path, program: &str, node: &str, args: &[&str]) -> Command {
    let mut command = Command::new("timeout");
    command
        .args([&WITHIN.as_secs().to_string(), "runuser", "-u", RUN_AS, "--", &format!("{BIN}/{program}"), "-n", node])
        .args(args)
        .current_dir(cwd)
        .env("HOME", HOME)
        .stdin(Stdio::null());
    command
}

/// Waits until node `i` sees as running exactly the nodes that `running` says run.
fn sees_running(nodes: &[Node], running: &[bool], i: usize) {
    let node = &nodes[i];
    let mut expected: Vec<&str> = (0..nodes.len()).filter(|n| running[*n]).map(|n| nodes[n].name.as_str()).collect();
    expected.sort_unstable();
    let deadline = Instant::now() + WITHIN;
    loop {
        let seen = ctl(&node.base, &node.name, &["eval", "rabbit_nodes:all_running()."]);
        let text = seen.as_deref().unwrap_or("").replace(['[', ']'], "").replace(char::is_whitespace, "");
        let mut names: Vec<&str> = text.split(',').filter(|s| !s.is_empty()).collect();
        names.sort_unstable();
        if names == expected {
            return;
        }
        assert!(Instant::now() < deadline, "{} sees {seen:?} running, not {expected:?}", node.name);
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Three RabbitMQ nodes of the test's own, clustered, each on a free port of 127.0.0.1 (guest
/// may connect: it is a loopback connection). Nodes are numbered 0, 1, 2, as in
/// [`RabbitCluster::urls`]; node 0 is the one the others joined. Dropping the cluster (a panic
/// included) kills every node still running and removes the folder.
///
/// ```no_run
/// # async fn example() {
/// use actix_outbox_test_support::RabbitCluster;
/// let mut cluster = RabbitCluster::start().await;
/// let config = actix_outbox::sink::RabbitConfig::cluster(cluster.urls());
/// // ... the sink connects to node 0, then to the next on each reconnection ...
/// cluster.kill(0).await; // SIGKILL: as if its machine died
/// cluster.start_node(0).await; // back, and in the cluster again
/// # }
/// ```
pub struct RabbitCluster {
    nodes: Vec<Node>,
    /// Which nodes run (as far as this fixture knows: it alone starts and stops them).
    running: Vec<bool>,
    dir: OwnedDir,
}

impl RabbitCluster {
    /// Starts three nodes, joins nodes 1 and 2 to node 0 (`stop_app`, `join_cluster`,
    /// `start_app`), and returns once each of them sees all three running.
    pub async fn start() -> RabbitCluster {
        tokio::task::spawn_blocking(Self::start_blocking).await.expect("start thread")
    }

    fn start_blocking() -> RabbitCluster {
        let dir = OwnedDir::owned_by("rabbit-cluster", RUN_AS);
        let prefix = format!("ao{}x{}{:04x}", std::process::id(), CLUSTERS.fetch_add(1, Ordering::Relaxed), {
            crate::rand_suffix() & 0xffff
        });
        let nodes: Vec<Node> = (0..NODES)
            .map(|i| {
                let base = dir.path().join(format!("node{i}"));
                for sub in ["", "mnesia", "log"] {
                    let path = base.join(sub);
                    std::fs::create_dir_all(&path).unwrap();
                    dir.give_to_owner(&path);
                }
                std::fs::write(base.join("plugins"), "[].\n").unwrap();
                std::fs::write(base.join("rabbitmq.conf"), SETTINGS).unwrap();
                for file in ["plugins", "rabbitmq.conf"] {
                    dir.give_to_owner(&base.join(file));
                }
                Node { name: format!("{prefix}_{}@localhost", i + 1), port: free_port(), dist: free_port(), base }
            })
            .collect();
        let mut cluster = RabbitCluster { nodes, running: vec![false; NODES], dir };
        // The VMs boot side by side; then each waits for its own.
        for i in 0..NODES {
            cluster.running[i] = true;
            cluster.nodes[i].boot();
        }
        for node in &cluster.nodes {
            node.wait_running();
        }
        let seed = cluster.nodes[0].name.clone();
        for node in &cluster.nodes[1..] {
            for args in [&["stop_app"][..], &["join_cluster", &seed], &["start_app"]] {
                ctl(&node.base, &node.name, args)
                    .unwrap_or_else(|e| panic!("{} {args:?}: {e}\n{}", node.name, node.log_tail()));
            }
        }
        for i in 0..NODES {
            sees_running(&cluster.nodes, &cluster.running, i);
        }
        cluster
    }

    /// The AMQP URL of each node (guest/guest, vhost `/`), node 0 first.
    pub fn urls(&self) -> Vec<String> {
        (0..NODES).map(|i| self.url(i)).collect()
    }

    /// The AMQP URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.nodes[i].port)
    }

    /// The AMQP port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// The Erlang node name of node `i` (`ao…_<i+1>@localhost`).
    pub fn node_name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// Whether node `i` runs (as far as this fixture started and stopped it).
    pub fn is_running(&self, i: usize) -> bool {
        self.running[i]
    }

    /// The pid of node `i`'s Erlang VM, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].pid()
    }

    /// A running node other than `not`, to ask things of.
    fn other_running(&self, not: Option<usize>) -> usize {
        (0..NODES).find(|n| self.running[*n] && Some(*n) != not).expect("a running node")
    }

    /// SIGKILL to node `i`'s VM, as if its machine died: its connections are cut at once, it
    /// says goodbye to nobody. Returns once the process is gone.
    pub async fn kill(&mut self, i: usize) {
        let (name, pid) = (self.nodes[i].name.clone(), self.nodes[i].pid());
        let pid = pid.unwrap_or_else(|| panic!("{name} does not run"));
        tokio::task::spawn_blocking(move || kill_pid(pid, &name)).await.unwrap();
        self.running[i] = false;
    }

    /// Stops node `i` the way an operator would (`rabbitmqctl stop`): its queues' leaders hand
    /// over, its connections are closed with `connection.close` (320). Returns once its VM has
    /// exited.
    pub async fn stop(&mut self, i: usize) {
        let node = &self.nodes[i];
        let pid = node.pid();
        run_blocking(tool_command(&node.base, "rabbitmqctl", &node.name, &["stop"]))
            .await
            .unwrap_or_else(|e| panic!("stop {}: {e}", node.name));
        if let Some(pid) = pid {
            let name = node.name.clone();
            let deadline = Instant::now() + Duration::from_secs(60);
            while runs_node(pid, &name) {
                assert!(Instant::now() < deadline, "{name} still runs a minute after stop");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        self.running[i] = false;
    }

    /// Starts node `i` again (killed or stopped), on its ports and with its database: it comes
    /// back as a member of the cluster. Returns once every running node sees it running.
    pub async fn start_node(&mut self, i: usize) {
        assert!(!self.running[i], "{} runs already", self.nodes[i].name);
        self.running[i] = true;
        let (nodes, running) = (self.nodes.clone(), self.running.clone());
        tokio::task::spawn_blocking(move || {
            nodes[i].boot();
            nodes[i].wait_running();
            for n in (0..NODES).filter(|n| running[*n]) {
                sees_running(&nodes, &running, n);
            }
        })
        .await
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic.into_panic()));
    }

    /// `rabbitmq-queues quorum_status` of `queue` (vhost `/`), asked of a running node: each
    /// member's node name and Raft state (`leader`, `follower`, ...).
    pub async fn quorum_status(&self, queue: &str) -> Vec<(String, String)> {
        let node = &self.nodes[self.other_running(None)];
        let out = run_blocking(tool_command(
            &node.base,
            "rabbitmq-queues",
            &node.name,
            &["quorum_status", queue, "--formatter", "json", "--quiet"],
        ))
        .await
        .unwrap_or_else(|e| panic!("quorum_status {queue}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        let members: Vec<serde_json::Value> =
            serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("quorum_status {queue}: {e}: {text}"));
        members
            .iter()
            .map(|m| {
                let field = |k: &str| m.get(k).and_then(|v| v.as_str()).unwrap_or_default().to_owned();
                (field("Node Name"), field("Raft State"))
            })
            .collect()
    }

    /// The node whose member leads quorum queue `queue`, if one does right now (none during an
    /// election).
    pub async fn leader_of(&self, queue: &str) -> Option<usize> {
        let status = self.quorum_status(queue).await;
        let leader = status.iter().find(|(_, state)| state == "leader")?;
        self.nodes.iter().position(|n| n.name == leader.0)
    }

    /// Moves the leadership of quorum queue `queue` to node `to` (RabbitMQ 3.10 has no
    /// command for one queue: `rabbit_quorum_queue:transfer_leadership/2` through
    /// `rabbitmqctl eval`), and waits until `to` leads it.
    pub async fn transfer_leadership(&self, queue: &str, to: usize) {
        let node = &self.nodes[self.other_running(None)];
        let expr = format!(
            "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"{queue}\">>)), \
             rabbit_quorum_queue:transfer_leadership(Q, '{}').",
            self.nodes[to].name
        );
        let out = run_blocking(tool_command(&node.base, "rabbitmqctl", &node.name, &["eval", &expr]))
            .await
            .unwrap_or_else(|e| panic!("transfer_leadership {queue}: {e}"));
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        let deadline = Instant::now() + WITHIN;
        while self.leader_of(queue).await != Some(to) {
            assert!(Instant::now() < deadline, "node {to} does not lead {queue} ({said})");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Node `i`'s RabbitMQ log so far.
    pub fn log(&self, i: usize) -> String {
        let node = &self.nodes[i];
        std::fs::read_to_string(node.base.join("log").join(format!("{}.log", node.name))).unwrap_or_default()
    }

    /// The cluster's folder (removed on drop).
    pub fn folder(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for node in &self.nodes {
            let mut pids = pids_of(&node.name);
            pids.extend(node.pid());
            pids.sort_unstable();
            pids.dedup();
            for pid in pids {
                kill_pid(pid, &node.name);
            }
        }
        // The folder goes with `self.dir`.
    }
}
