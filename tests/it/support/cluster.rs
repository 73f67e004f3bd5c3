//! A real Redis Cluster for tests: three masters with a replica each, `redis-server`
//! processes on free loopback ports (below 55,535: each node's cluster bus listens on its
//! port + 10,000), nothing kept but the nodes' own `nodes.conf` in a directory of their own,
//! stopped when dropped. A small node timeout (1 s) makes a failover take seconds.

use std::{
    collections::BTreeSet,
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::server::Connection;

/// One node of the cluster.
struct Node {
    child: Option<Child>,
    port: u16,
}

pub(crate) struct Cluster {
    nodes: Vec<Node>,
    dir: PathBuf,
}

/// One cluster at a time in the test binary: six servers per test, several tests at once
/// on two cores, and the nodes' one-second failure detection would fail over masters
/// nobody stopped.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Cluster {
    /// Waits for this test's turn, then starts a cluster as [`start`](Self::start) does (on
    /// a multi-threaded runtime). The turn ends when the guard drops: keep it as long as
    /// the cluster.
    pub(crate) async fn start_in_turn() -> (tokio::sync::MutexGuard<'static, ()>, Self) {
        let turn = TURN.lock().await;
        (turn, tokio::task::block_in_place(Self::start))
    }

    /// Starts six nodes, makes them a cluster of three masters with a replica each, and
    /// waits until every node says the cluster is ok and every replica is in sync.
    ///
    /// # Panics
    ///
    /// When `redis-server` or `redis-cli` is missing, with a message that says how to
    /// install them, or when the cluster does not form within 20 s.
    pub(crate) fn start() -> Self {
        Self::start_with(1)
    }

    /// Three masters with `replicas` replicas each (0: masters only, as the bench runs it,
    /// so that replicas do not take the CPU of a small machine); otherwise as
    /// [`start`](Self::start).
    pub(crate) fn start_with(replicas: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-batch-lock-cluster-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        let ports = free_ports(3 * (1 + replicas));
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        for port in ports {
            let node_dir = cluster.dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            cluster.nodes.push(Node {
                child: Some(spawn(port, &node_dir)),
                port,
            });
        }
        for node in &cluster.nodes {
            wait_until(Duration::from_secs(10), "a node to answer PING", || {
                query::<String>(node.port, &mut redis::cmd("PING")).is_some()
            });
        }
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "could not run redis-cli ({e}): install it with `apt-get install redis-server`"
                )
            });
        assert!(created.success(), "redis-cli --cluster create failed");
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    /// Every node's URL.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| url(n.port)).collect()
    }

    /// The ports of the live masters, as the first live node sees them.
    pub(crate) fn masters(&self) -> Vec<u16> {
        let mut masters: Vec<u16> = self
            .live()
            .filter(|&port| role(port).as_deref() == Some("master"))
            .collect();
        masters.sort_unstable();
        masters
    }

    /// The lock keys (not the fencing counter `lock:`) on each live master.
    pub(crate) fn locks_on_masters(&self) -> Vec<BTreeSet<String>> {
        self.masters()
            .into_iter()
            .map(|port| {
                query::<Vec<String>>(port, redis::cmd("KEYS").arg("lock:?*"))
                    .unwrap_or_default()
                    .into_iter()
                    .collect()
            })
            .collect()
    }

    /// Whether no master holds a lock key.
    pub(crate) fn empty(&self) -> bool {
        self.locks_on_masters().iter().all(BTreeSet::is_empty)
    }

    /// Sets the configuration `name` to `value` on every live node.
    pub(crate) fn config_set(&self, name: &str, value: &str) {
        for port in self.live() {
            let _: () = self.cmd(port, redis::cmd("CONFIG").arg("SET").arg(name).arg(value));
        }
    }

    /// What `CLUSTER SLOTS` answers on every live node, replicas too.
    pub(crate) fn slots_everywhere(&self) -> Vec<redis::Value> {
        self.live()
            .map(|port| self.cmd(port, redis::cmd("CLUSTER").arg("SLOTS")))
            .collect()
    }

    /// Runs `cmd` on the master at `port`.
    pub(crate) fn cmd<T: redis::FromRedisValue>(&self, port: u16, cmd: &mut redis::Cmd) -> T {
        query(port, cmd).expect("the node answers")
    }

    /// Runs `cmd` on the node at `port`, which may not answer yet (a node just resumed or
    /// promoted, on a loaded machine): `None` then.
    pub(crate) fn try_cmd<T: redis::FromRedisValue>(
        &self,
        port: u16,
        cmd: &mut redis::Cmd,
    ) -> Option<T> {
        query(port, cmd)
    }

    /// Kills the master at `port` as a crash would.
    pub(crate) fn kill(&mut self, port: u16) {
        let node = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The master that serves `key`'s slot (by the master at `asked`, `CLUSTER SLOTS`), and
    /// the live nodes that replicate it (by their own `INFO`).
    pub(crate) fn shard_of(&self, asked: u16, key: &str) -> (u16, Vec<u16>) {
        let slot: i64 = self.cmd(asked, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key));
        let ranges: Vec<redis::Value> = self.cmd(asked, redis::cmd("CLUSTER").arg("SLOTS"));
        let master = ranges
            .into_iter()
            .find_map(|range| {
                let redis::Value::Array(fields) = range else {
                    return None;
                };
                let number = |i: usize| redis::from_redis_value::<i64>(fields[i].clone()).ok();
                if !(number(0)?..=number(1)?).contains(&slot) {
                    return None;
                }
                let redis::Value::Array(node) = &fields[2] else {
                    return None;
                };
                redis::from_redis_value::<u16>(node[1].clone()).ok()
            })
            .unwrap_or_else(|| panic!("no master serves the slot of {key}"));
        let replicas = self
            .live()
            .filter(|&port| info(port, "replication", "master_port") == Some(master.to_string()))
            .collect();
        (master, replicas)
    }

    /// Freezes (`STOP`) or thaws (`CONT`) the node at `port`.
    pub(crate) fn signal(&self, port: u16, signal: &str) {
        let node = self.nodes.iter().find(|n| n.port == port).unwrap();
        let pid = node.child.as_ref().expect("a live node").id();
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} {pid}");
    }

    /// How many replicas are connected to the master at `port`, as it says.
    pub(crate) fn connected_replicas(&self, port: u16) -> Option<u64> {
        info(port, "replication", "connected_slaves")?.parse().ok()
    }

    /// Waits until a replica took over from the master at `port` (killed) and every live
    /// node says the cluster is ok.
    pub(crate) fn wait_for_failover(&self, port: u16, limit: Duration) {
        wait_until(limit, "a replica to take over", || {
            self.live().all(cluster_ok)
                && self.masters().len() == 3
                && !self.masters().contains(&port)
        });
    }

    /// Moves the slot of `key`, with the keys in it, to the master at `to`, as `redis-cli
    /// --cluster reshard` would (importing, migrating, each key with `MIGRATE`, then the
    /// new owner on every master, the new one first), and waits until every master says
    /// so: a client that read the map before has a stale one.
    pub(crate) fn move_slot(&self, key: &str, to: u16) {
        let (from, _) = self.shard_of(to, key);
        let slot: i64 = self.cmd(to, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key));
        let id = |port: u16| -> String { self.cmd(port, redis::cmd("CLUSTER").arg("MYID")) };
        let setslot = |port: u16, state: &str, node: u16| {
            let _: () = self.cmd(
                port,
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg(state)
                    .arg(id(node)),
            );
        };
        setslot(to, "IMPORTING", from);
        setslot(from, "MIGRATING", to);
        loop {
            let keys: Vec<String> = self.cmd(
                from,
                redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(100),
            );
            if keys.is_empty() {
                break;
            }
            let _: () = self.cmd(
                from,
                redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(to)
                    .arg("")
                    .arg(0)
                    .arg(5_000)
                    .arg("KEYS")
                    .arg(&keys),
            );
        }
        let mut masters = self.masters();
        masters.sort_by_key(|&port| (port != to, port == from));
        for port in masters {
            setslot(port, "NODE", to);
        }
        wait_until(Duration::from_secs(10), "every master to agree", || {
            self.masters()
                .into_iter()
                .all(|port| self.shard_of(port, key).0 == to)
        });
    }

    /// Moves `slots` slots from the master at `from` to the master at `to` with
    /// `redis-cli --cluster reshard`, in batches of `pipeline` keys per `MIGRATE`.
    pub(crate) fn reshard(from: u16, to: u16, slots: u32) {
        let id = |port: u16| -> String {
            query(port, redis::cmd("CLUSTER").arg("MYID")).expect("the node answers")
        };
        let status = Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .args(["--cluster-pipeline", "10"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run redis-cli --cluster reshard");
        assert!(status.success(), "redis-cli --cluster reshard failed");
    }

    /// How many slots the master at `port` serves.
    pub(crate) fn slots_of(&self, port: u16) -> u64 {
        let info: String = self.cmd(port, redis::cmd("CLUSTER").arg("NODES"));
        let line = info.lines().find(|l| l.contains("myself")).unwrap();
        line.split(' ')
            .skip(8)
            .map(|range| match range.split_once('-') {
                _ if range.starts_with('[') => 0,
                Some((a, b)) => b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap() + 1,
                None => 1,
            })
            .sum()
    }

    /// The total of a command's calls on every live master, from `INFO commandstats`.
    pub(crate) fn calls_of(&self, command: &str) -> u64 {
        self.command_stat(command, "calls")
    }

    /// The total of a command's calls that every live master refused before running them
    /// (`MOVED`, `ASK`, out of memory, ...), from `INFO commandstats`.
    pub(crate) fn rejected_calls_of(&self, command: &str) -> u64 {
        self.command_stat(command, "rejected_calls")
    }

    fn command_stat(&self, command: &str, field: &str) -> u64 {
        self.masters()
            .into_iter()
            .map(|port| {
                let info: String = self.cmd(port, redis::cmd("INFO").arg("commandstats"));
                let stats = info
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:")));
                stats
                    .into_iter()
                    .flat_map(|stats| stats.split(','))
                    .find_map(|pair| pair.strip_prefix(&format!("{field}=")))
                    .and_then(|value| value.parse().ok())
                    .unwrap_or(0)
            })
            .sum()
    }

    fn live(&self) -> impl Iterator<Item = u16> + '_ {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
    }

    fn wait_ok(&self, limit: Duration) {
        wait_until(limit, "the cluster to be ok", || {
            self.live().all(|port| {
                cluster_ok(port)
                    && (role(port).as_deref() == Some("master") || replica_in_sync(port))
            })
        });
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

/// One command on a fresh connection to the node at `port`; None when it does not answer.
fn query<T: redis::FromRedisValue>(port: u16, cmd: &mut redis::Cmd) -> Option<T> {
    let mut connection = Connection::open(&url(port), Duration::from_millis(500)).ok()?;
    cmd.query(&mut connection).ok()
}

fn info(port: u16, section: &str, field: &str) -> Option<String> {
    let text: String = query(port, redis::cmd("INFO").arg(section))?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_owned())
}

fn role(port: u16) -> Option<String> {
    info(port, "replication", "role")
}

fn replica_in_sync(port: u16) -> bool {
    info(port, "replication", "master_link_status").as_deref() == Some("up")
}

fn cluster_ok(port: u16) -> bool {
    let text: Option<String> = query(port, redis::cmd("CLUSTER").arg("INFO"));
    text.is_some_and(|t| t.contains("cluster_state:ok"))
}

fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `count` ports below 55,535 whose cluster bus port (+10,000) is free too.
/// `count` free ports, each with its cluster bus port (10,000 above) free too. Both below
/// the kernel's ephemeral range (32768 and up by default): a port from that range can be
/// taken, between this check and the node's start, as the local port of any outgoing
/// connection of the suite (hundreds of pooled ones), and the node then fails to bind.
fn free_ports(count: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < count {
        let port = fastrand::u16(20_000..22_760);
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if !ports.contains(&port) && free(port) && free(port + 10_000) {
            ports.push(port);
        }
    }
    ports
}

fn spawn(port: u16, dir: &std::path::Path) -> Child {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ])
        .args(["--cluster-node-timeout", "1000"])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--repl-diskless-sync-delay",
            "0",
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "could not start redis-server ({e}). The cluster tests start their own servers: \
                 install it with `apt-get install redis-server` (or put redis-server on PATH)"
            )
        })
}
