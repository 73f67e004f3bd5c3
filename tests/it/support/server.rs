//! Real `redis-server` processes for tests: each on a free loopback port, with nothing kept
//! on disk, stopped when dropped. Never the server on the default port 6379.

use std::{
    collections::BTreeSet,
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub(crate) struct RedisServer {
    child: Option<Child>,
    port: u16,
    /// Arguments beyond the defaults (a replica's `--replicaof`), kept for a restart.
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed, with a message that says how to install it.
    pub(crate) fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// Starts a replica of `master` (`--replicaof`), as [`start`](Self::start) does; it
    /// may not be in sync yet.
    pub(crate) fn start_replica_of(master: &Self) -> Self {
        let replicaof = ["--replicaof", "127.0.0.1", &master.port.to_string()];
        Self::start_with(replicaof.map(str::to_owned).to_vec())
    }

    fn start_with(extra: Vec<String>) -> Self {
        for _ in 0..5 {
            let port = free_port();
            let mut server = Self {
                child: Some(spawn(port, &extra)),
                port,
                extra: extra.clone(),
            };
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            // Another process took the port between our probe and the server's bind.
            server.kill();
        }
        panic!("redis-server did not start on a free loopback port after 5 attempts");
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub(crate) fn pool(&self) -> deadpool_redis::Pool {
        deadpool_redis::Config::from_url(self.url())
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .expect("a valid Redis URL")
    }

    /// A pool of at most `size` connections, as a service would give the store its own.
    pub(crate) fn pool_of(&self, size: usize) -> deadpool_redis::Pool {
        deadpool_redis::Config::from_url(self.url())
            .builder()
            .expect("a valid Redis URL")
            .max_size(size)
            .runtime(deadpool_redis::Runtime::Tokio1)
            .build()
            .expect("a pool")
    }

    /// A plain synchronous connection, for looking at the server from outside the crate.
    pub(crate) fn connection(&self) -> Connection {
        connect(&self.url())
    }

    /// How many keys the server holds in all.
    pub(crate) fn dbsize(&self) -> u64 {
        redis::cmd("DBSIZE")
            .query(&mut self.connection())
            .expect("DBSIZE")
    }

    /// The keys that match `pattern`.
    pub(crate) fn keys(&self, pattern: &str) -> Vec<String> {
        redis::cmd("KEYS")
            .arg(pattern)
            .query(&mut self.connection())
            .expect("KEYS")
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers.
    pub(crate) fn pause(&self) {
        self.signal("STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub(crate) fn resume(&self) {
        self.signal("CONT");
    }

    /// Kills the server as a crash would.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a fresh, empty server on the same port after [`kill`](Self::kill).
    pub(crate) fn restart(&mut self) {
        self.kill();
        self.child = Some(spawn(self.port, &self.extra));
        assert!(
            self.wait_ready(Duration::from_secs(10)),
            "redis-server did not restart"
        );
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("server is running").id();
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "kill -{signal} {pid} failed"
        );
    }

    fn wait_ready(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(Ok(Some(_exited))) = self.child.as_mut().map(Child::try_wait) {
                return false;
            }
            let pong = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if pong.is_ok_and(|p| p == "PONG") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused server would ignore SIGKILL only until resumed; SIGKILL works anyway.
        self.kill();
    }
}

/// A plain synchronous connection to the server at `url`.
fn connect(url: &str) -> Connection {
    Connection::open(url, Duration::from_secs(2)).expect("connect to the test redis-server")
}

/// A plain synchronous connection, for looking at a server from outside the crate, that
/// sends a command again when a signal to the test process interrupted the wait for its
/// answer.
///
/// A blocked read of a socket with a read timeout is never restarted after a signal
/// handler ran (`signal(7)`): it fails with EINTR, which failed a full run now and then
/// while tests started, froze and killed processes. Every command the tests send this way
/// is one that may run twice, and the connection skips the late answer of the first.
pub(crate) struct Connection(redis::Connection);

impl Connection {
    /// Opens one to `url`, with the connect bounded by `limit` and each read by 5 s.
    pub(crate) fn open(url: &str, limit: Duration) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let attempt = || client.get_connection_with_timeout(limit);
        let connection = attempt().or_else(|error| {
            if interrupted(&error) {
                attempt()
            } else {
                Err(error)
            }
        })?;
        connection.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(Self(connection))
    }

    /// The connection as a subscriber, whose reads are its own to bound and retry.
    pub(crate) fn as_pubsub(&mut self) -> redis::PubSub<'_> {
        self.0.as_pubsub()
    }
}

/// Whether a signal interrupted the call (EINTR).
fn interrupted(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::Io && error.to_string().contains("os error 4")
}

impl redis::ConnectionLike for Connection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> redis::RedisResult<redis::Value> {
        let mut tries = 1;
        loop {
            match self.0.req_packed_command(cmd) {
                Err(error) if interrupted(&error) && tries < 3 => tries += 1,
                answer => return answer,
            }
        }
    }

    // The tests send no pipeline this way.
    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> redis::RedisResult<Vec<redis::Value>> {
        self.0.req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }

    fn check_connection(&mut self) -> bool {
        self.0.check_connection()
    }

    fn is_open(&self) -> bool {
        self.0.is_open()
    }
}

/// Looks at a server from outside the crate, with a plain synchronous connection per
/// command. Holds only the URL, so that handlers and tasks can keep a clone.
#[derive(Clone)]
pub(crate) struct Observer {
    url: String,
}

/// The prefixes the tests use: each names its namespace's fencing counter, which lives
/// as long as the server, and is never a lock (empty keys are refused).
const FENCING_COUNTERS: [&str; 2] = ["lock:", "tenant-a/"];

/// The registry of the claims that waiters with big batches keep their place in line with,
/// and the start of each claim's key.
pub(crate) const CLAIMS: &str = "tower-batch-lock:claims";

impl Observer {
    pub(crate) fn of(server: &RedisServer) -> Self {
        Self { url: server.url() }
    }

    pub(crate) fn connection(&self) -> Connection {
        connect(&self.url)
    }

    pub(crate) fn cmd<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> T {
        cmd.query(&mut self.connection()).unwrap()
    }

    /// Makes the server log every command it is sent (not those a script calls) in its
    /// `SLOWLOG`, up to 100,000 of them.
    pub(crate) fn log_every_command(&self) {
        for (setting, value) in [("slowlog-max-len", 100_000), ("slowlog-log-slower-than", 0)] {
            self.cmd::<()>(redis::cmd("CONFIG").arg("SET").arg(setting).arg(value));
        }
    }

    /// The commands logged since `SLOWLOG RESET` (see [`log_every_command`]) that clients
    /// sent, or else those that scripts called (`by_scripts`: Redis logs them as the client
    /// `?:0`), each as the text of its arguments, the command's name in lower case.
    ///
    /// [`log_every_command`]: Self::log_every_command
    pub(crate) fn logged_commands(&self, by_scripts: bool) -> Vec<Vec<String>> {
        let log: redis::Value = self.cmd(redis::cmd("SLOWLOG").arg("GET").arg(-1));
        let redis::Value::Array(entries) = log else {
            panic!("SLOWLOG GET answers a list: {log:?}");
        };
        let text = |value: &redis::Value| match value {
            redis::Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
            _ => None,
        };
        entries
            .iter()
            .filter_map(|entry| {
                let redis::Value::Array(fields) = entry else {
                    return None;
                };
                let redis::Value::Array(args) = fields.get(3)? else {
                    return None;
                };
                if (fields.get(4).and_then(text).as_deref() == Some("?:0")) != by_scripts {
                    return None;
                }
                let mut command: Vec<String> = args.iter().filter_map(text).collect();
                command[0].make_ascii_lowercase();
                Some(command)
            })
            .collect()
    }

    /// Every key on the server but the fencing counters, sorted. (`KEYS *` rather than a
    /// prefix pattern, so that glob characters inside test keys cannot skew the answer.)
    pub(crate) fn all_keys(&self) -> BTreeSet<String> {
        self.cmd::<Vec<String>>(redis::cmd("KEYS").arg("*"))
            .into_iter()
            .filter(|key| !FENCING_COUNTERS.contains(&key.as_str()))
            .collect()
    }

    /// The keys under `prefix`.
    pub(crate) fn under(&self, prefix: &str) -> BTreeSet<String> {
        self.all_keys()
            .into_iter()
            .filter(|k| k.starts_with(prefix))
            .collect()
    }

    /// The lock keys of the default namespace.
    pub(crate) fn locks(&self) -> BTreeSet<String> {
        self.under("lock:")
    }

    /// What holds `key`: the owner token of a held lock, or the plain value of any other
    /// string key.
    pub(crate) fn get(&self, key: &str) -> Option<String> {
        let value: Option<String> = self.cmd(redis::cmd("GET").arg(key));
        value.map(|v| match LockValue::parse(&v) {
            Some(LockValue {
                owner: Some(owner), ..
            }) => owner,
            _ => v,
        })
    }

    /// The tickets of the waiters whose claim (a big batch's place in line, kept apart
    /// from its keys) names `key`, in line order.
    pub(crate) fn claims_on(&self, key: &str) -> Vec<u128> {
        let mut connection = self.connection();
        let tickets: Vec<String> = redis::cmd("ZRANGE")
            .arg(CLAIMS)
            .arg(0)
            .arg(-1)
            .query(&mut connection)
            .unwrap();
        let mut on: Vec<u128> = tickets
            .into_iter()
            .filter(|ticket| {
                redis::cmd("SISMEMBER")
                    .arg(format!("{CLAIMS}:{ticket}"))
                    .arg(key)
                    .query(&mut connection)
                    .unwrap()
            })
            .map(|ticket| ticket.parse().unwrap())
            .collect();
        on.sort_unstable();
        on
    }

    /// Puts a live claim of the waiter with `ticket` on `keys`, for a minute of Redis's
    /// clock, as the scripts write one.
    pub(crate) fn claim(&self, ticket: &str, keys: &[&str]) {
        let [seconds, _]: [u64; 2] = self.cmd(&mut redis::cmd("TIME"));
        self.cmd::<()>(
            redis::cmd("SADD")
                .arg(format!("{CLAIMS}:{ticket}"))
                .arg(keys),
        );
        self.cmd::<()>(
            redis::cmd("ZADD")
                .arg(CLAIMS)
                .arg((seconds + 60) * 1000)
                .arg(ticket),
        );
    }

    /// The lock value under `key`, if it is one.
    pub(crate) fn lock(&self, key: &str) -> Option<LockValue> {
        lock_value(&mut self.connection(), key)
    }

    pub(crate) fn set(&self, key: &str, value: &str) {
        self.cmd::<()>(redis::cmd("SET").arg(key).arg(value));
    }

    /// How many keys `DEL` removed.
    pub(crate) fn del(&self, key: &str) -> u64 {
        self.cmd(redis::cmd("DEL").arg(key))
    }

    pub(crate) fn pttl(&self, key: &str) -> i64 {
        self.cmd(redis::cmd("PTTL").arg(key))
    }

    /// How many keys [`all_keys`](Self::all_keys) would list.
    pub(crate) fn dbsize(&self) -> u64 {
        let counters = FENCING_COUNTERS
            .iter()
            .map(|&k| self.cmd::<u64>(redis::cmd("EXISTS").arg(k)));
        self.cmd::<u64>(&mut redis::cmd("DBSIZE")) - counters.sum::<u64>()
    }

    /// How many script calls (`FCALL` of the crate's functions, `EVALSHA` and `EVAL`) the
    /// server has received.
    pub(crate) fn script_calls(&self) -> u64 {
        self.calls(&["fcall", "evalsha", "eval"])
    }

    /// The CPU time of the server's main thread so far (`INFO cpu`): the thread that runs
    /// every command.
    pub(crate) fn main_thread_cpu(&self) -> Duration {
        let info: String = self.cmd(redis::cmd("INFO").arg("cpu"));
        let seconds: f64 = info
            .lines()
            .filter(|line| {
                line.starts_with("used_cpu_user_main_thread:")
                    || line.starts_with("used_cpu_sys_main_thread:")
            })
            .filter_map(|line| line.split(':').nth(1)?.trim().parse::<f64>().ok())
            .sum();
        Duration::from_secs_f64(seconds)
    }

    /// How many calls of `commands` the server has run, those the scripts made included.
    pub(crate) fn calls(&self, commands: &[&str]) -> u64 {
        let info: String = self.cmd(redis::cmd("INFO").arg("commandstats"));
        info.lines()
            .filter(|line| {
                commands
                    .iter()
                    .any(|command| line.starts_with(&format!("cmdstat_{command}:")))
            })
            .map(|line| {
                let calls = line.split("calls=").nth(1).expect("calls=");
                calls[..calls.find(',').unwrap()].parse::<u64>().unwrap()
            })
            .sum()
    }

    /// The `INFO commandstats` lines of the commands the server refused at least once
    /// (`rejected_calls`), those the scripts made included.
    pub(crate) fn refused_commands(&self) -> Vec<String> {
        let info: String = self.cmd(redis::cmd("INFO").arg("commandstats"));
        info.lines()
            .filter(|line| line.starts_with("cmdstat_") && !line.contains("rejected_calls=0,"))
            .map(str::to_owned)
            .collect()
    }
}

/// A lock key's value, as the crate's scripts write it: `<owner>:<hold>[:<hold>...]`, then
/// `|<ticket>/<until ms>` for each waiter's reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockValue {
    /// The owner token, when the key is held.
    pub(crate) owner: Option<String>,
    /// The hold ids.
    pub(crate) holds: Vec<String>,
    /// The waiters' tickets, in line order.
    pub(crate) reservations: Vec<u128>,
}

impl LockValue {
    pub(crate) fn parse(value: &str) -> Option<Self> {
        let (holds, queue) = value.split_once('|').map_or((value, ""), |(h, q)| (h, q));
        let mut parts = holds.split(':');
        let owner = parts.next().filter(|o| !o.is_empty()).map(str::to_owned);
        if owner.as_ref().is_some_and(|o| o.len() != 32) {
            return None;
        }
        let reservations = if value.contains('|') {
            queue
                .split('|')
                .map(|r| r.split_once('/').and_then(|(t, _)| t.parse().ok()))
                .collect::<Option<Vec<u128>>>()?
                .into_iter()
                // Ticket 0 is no waiter's: it marks where exclusive holds that
                // reservations outlive end.
                .filter(|&ticket| ticket != 0)
                .collect()
        } else {
            Vec::new()
        };
        Some(Self {
            owner,
            holds: parts.map(str::to_owned).collect(),
            reservations,
        })
    }
}

/// The lock value under `key` on `connection`, if it is one.
pub(crate) fn lock_value(
    connection: &mut impl redis::ConnectionLike,
    key: &str,
) -> Option<LockValue> {
    let value: Option<String> = redis::cmd("GET").arg(key).query(connection).ok()?;
    LockValue::parse(&value?)
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().unwrap().port()
}

fn spawn(port: u16, extra: &[String]) -> Child {
    Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(std::env::temp_dir())
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "could not start redis-server ({e}). The Redis tests start their own servers: \
                 install it with `apt-get install redis-server` (or put redis-server on PATH)"
            )
        })
}
