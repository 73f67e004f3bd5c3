//! Real `redis-server` processes for tests: each on a free loopback port, with nothing kept
//! on disk, stopped when dropped. Never the server on the default port 6379.
#![allow(dead_code)] // each test binary uses a different part of it

use std::{
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub(crate) struct RedisServer {
    child: Option<Child>,
    port: u16,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed, with a message that says how to install it.
    pub(crate) fn start() -> Self {
        for _ in 0..5 {
            let port = free_port();
            let mut server = Self {
                child: Some(spawn(port)),
                port,
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

    /// A plain synchronous connection, for looking at the server from outside the crate.
    pub(crate) fn connection(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).expect("a valid Redis URL");
        let connection = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect to the test redis-server");
        connection
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        connection
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
        self.child = Some(spawn(self.port));
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

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().unwrap().port()
}

fn spawn(port: u16) -> Child {
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
