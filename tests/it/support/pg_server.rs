//! A PostgreSQL server of a test's (or the bench's) own, on a free loopback port, in a
//! temporary directory: for what the machine's shared server must not undergo (a kill, a
//! restart); and a PgBouncer of a test's own in front of the machine's server. `initdb`,
//! `pg_ctl` and `pgbouncer` run as the `postgres` user when this runs as root (they refuse
//! root), and as the current user otherwise.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Command, Output},
    sync::atomic::{AtomicUsize, Ordering},
};

pub(crate) struct PgServer {
    dir: PathBuf,
    port: u16,
}

impl PgServer {
    /// Makes a cluster and starts it; waits until it accepts connections.
    ///
    /// # Panics
    ///
    /// When `initdb` or `pg_ctl` is missing or fails, with their output.
    pub(crate) fn start() -> Self {
        Self::start_with(false, "")
    }

    /// Makes a cluster that takes TCP connections over TLS only (a self-signed certificate
    /// made with `openssl`; `hostssl` alone in `pg_hba.conf`), and starts it.
    pub(crate) fn start_tls() -> Self {
        Self::start_with(true, "")
    }

    /// Makes a cluster with `settings` (lines of `postgresql.conf`), and starts it.
    pub(crate) fn start_with_settings(settings: &str) -> Self {
        Self::start_with(false, settings)
    }

    fn start_with(tls: bool, settings: &str) -> Self {
        let server = Self {
            dir: owned_dir("pg"),
            port: 0,
        };
        let data = server.data();
        check(
            as_owner("initdb")
                .args(["-D", &data, "-U", "postgres", "-A", "trust", "--no-sync"])
                .output(),
            "initdb (apt-get install postgresql, and put initdb and pg_ctl in PATH)",
        );
        if tls {
            server.require_tls();
        }
        server.append("postgresql.conf", &format!("\n{settings}\n"));
        server.start_on_a_free_port()
    }

    /// Starts the cluster made in its directory on a free port. Another server may take the
    /// port first: then it tries another.
    fn start_on_a_free_port(mut self) -> Self {
        for attempt in 1..=5 {
            self.port = free_port();
            match self.start_on_port() {
                Ok(()) => return self,
                Err(error) if attempt == 5 => panic!("{error}"),
                Err(_) => {}
            }
        }
        unreachable!("the last attempt panics")
    }

    /// A streaming replica of `primary` (`pg_basebackup -R`: it follows the primary), in a
    /// directory of its own, started on a free port.
    pub(crate) fn standby_of(primary: &PgServer) -> Self {
        let server = Self {
            dir: owned_dir("pg"),
            port: 0,
        };
        let (data, from) = (server.data(), primary.port.to_string());
        check(
            as_owner("pg_basebackup")
                .args(["-D", &data, "-R", "-X", "stream", "--no-sync"])
                .args(["-h", "127.0.0.1", "-p", &from, "-U", "postgres"])
                .output(),
            "pg_basebackup (apt-get install postgresql-client)",
        );
        server.start_on_a_free_port()
    }

    /// Stops it (`pg_ctl stop -m fast`), to [`run`](Self::run) it again later.
    pub(crate) fn stop(&self) {
        self.pg_ctl("stop", &["-m", "fast"]);
    }

    /// Promotes a standby (`pg_ctl promote`): it ends its recovery and takes writes, on a
    /// new timeline.
    pub(crate) fn promote(&self) {
        self.pg_ctl("promote", &[]);
    }

    /// `pg_ctl action` on its data directory with `options`, waiting for it to finish.
    fn pg_ctl(&self, action: &str, options: &[&str]) {
        let data = self.data();
        check(
            as_owner("pg_ctl")
                .args([action, "-D", &data, "-w"])
                .args(options)
                .output(),
            &format!("pg_ctl {action}"),
        );
    }

    /// The URL of its `postgres` database.
    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs `sql` in its `postgres` database with psql, and gives what it printed
    /// (unaligned, tuples only).
    pub(crate) fn query(&self, sql: &str) -> String {
        psql(&self.url(), sql)
    }

    /// What the server has logged so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// Kills the server as a crash would (`pg_ctl stop -m immediate`: no checkpoint, the
    /// next start replays the WAL).
    pub(crate) fn kill(&self) {
        self.pg_ctl("stop", &["-m", "immediate"]);
    }

    /// Starts it again, on the same port, with its data.
    pub(crate) fn run(&self) {
        if let Err(error) = self.start_on_port() {
            panic!("{error}");
        }
    }

    fn start_on_port(&self) -> Result<(), String> {
        let (data, log) = (self.data(), self.dir.join("log").display().to_string());
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c max_connections=200",
            self.port,
            self.dir.display()
        );
        let start = as_owner("pg_ctl")
            .args(["start", "-D", &data, "-l", &log, "-w", "-o", &options])
            .output();
        succeeded(start, "pg_ctl start")
    }

    /// A certificate and its key in the data directory, owned by the server's user, TLS
    /// on, and only TLS connections over TCP.
    fn require_tls(&self) {
        let data = self.data();
        let (crt, key) = (format!("{data}/server.crt"), format!("{data}/server.key"));
        check(
            as_owner("openssl")
                .args([
                    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                ])
                .args(["-subj", "/CN=localhost", "-keyout", &key, "-out", &crt])
                .output(),
            "openssl req (apt-get install openssl)",
        );
        check(as_owner("chmod").args(["600", &key]).output(), "chmod");
        self.append("postgresql.conf", "\nssl = on\n");
        // Read top down, first match wins: TCP without TLS matches no line, and is refused.
        std::fs::write(format!("{data}/pg_hba.conf"), "").unwrap();
        self.append(
            "pg_hba.conf",
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        );
    }

    /// Appends `text` to the file `name` of its data directory.
    fn append(&self, name: &str, text: &str) {
        let path = format!("{}/{name}", self.data());
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.data();
        let _ = as_owner("pg_ctl")
            .args(["stop", "-D", &data, "-m", "immediate", "-w"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// PgBouncer in transaction mode (each transaction may run on another server connection)
/// on a free loopback port, in front of the machine's server at 127.0.0.1:5432, for every
/// database there, as user `postgres` (trust), with 4 server connections a database, and
/// without tracking prepared statements (`max_prepared_statements = 0`, where the version
/// has the setting: from 1.21, and on by default from 1.24; 1.18 refuses it as unknown).
pub(crate) struct PgBouncer {
    dir: PathBuf,
    port: u16,
}

impl PgBouncer {
    /// Starts it, as a daemon; waits until it accepts connections.
    ///
    /// # Panics
    ///
    /// When `pgbouncer` is missing or does not start, with what it logged.
    pub(crate) fn start() -> Self {
        let mut bouncer = Self {
            dir: owned_dir("pgbouncer"),
            port: 0,
        };
        let tracking = if tracks_prepared_statements() {
            "max_prepared_statements = 0\n"
        } else {
            ""
        };
        for attempt in 1..=5 {
            bouncer.port = free_port();
            let config = bouncer.dir.join("pgbouncer.ini");
            let settings = format!(
                "[databases]\n* = host=127.0.0.1 port=5432 user=postgres\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {}\nunix_socket_dir =\n\
                 auth_type = any\npool_mode = transaction\ndefault_pool_size = 4\n\
                 max_client_conn = 200\nlogfile = {}\npidfile = {}\n{}",
                bouncer.port,
                bouncer.dir.join("log").display(),
                bouncer.pidfile().display(),
                tracking,
            );
            std::fs::write(&config, settings).expect("the configuration written");
            let started = as_owner("pgbouncer").arg("-d").arg(&config).output();
            let answered =
                succeeded(started, "pgbouncer (apt-get install pgbouncer)").and_then(|()| {
                    // Its own log says it bound the port: another process that took the port
                    // meanwhile would answer a connection too.
                    let listening = format!("listening on 127.0.0.1:{}", bouncer.port);
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                    let mut log = String::new();
                    while std::time::Instant::now() < deadline {
                        log = std::fs::read_to_string(bouncer.dir.join("log")).unwrap_or_default();
                        if log.contains(&listening)
                            && std::net::TcpStream::connect(("127.0.0.1", bouncer.port)).is_ok()
                        {
                            return Ok(());
                        }
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                    Err(format!("pgbouncer did not listen within 10 s: {log}"))
                });
            match answered {
                Ok(()) => return bouncer,
                Err(error) if attempt == 5 => panic!("{error}"),
                Err(_) => bouncer.stop(),
            }
        }
        unreachable!("the last attempt panics")
    }

    /// The URL of the database `name` through it.
    pub(crate) fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    fn pidfile(&self) -> PathBuf {
        self.dir.join("pid")
    }

    fn stop(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.pidfile()) {
            let _ = Command::new("kill").arg(pid.trim()).output();
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the installed PgBouncer can track prepared statements (1.21 or later), and so
/// knows `max_prepared_statements`: `pgbouncer --version` starts `PgBouncer 1.18.0`.
fn tracks_prepared_statements() -> bool {
    let Ok(out) = Command::new("pgbouncer").arg("--version").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut version = text
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .split('.')
        .map(|part| part.parse::<u32>().unwrap_or(0));
    (version.next().unwrap_or(0), version.next().unwrap_or(0)) >= (1, 21)
}

/// A new temporary directory that `postgres` owns when this runs as root.
fn owned_dir(what: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tower-batch-lock-{what}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    if as_root() {
        check(
            Command::new("chown").arg("postgres").arg(&dir).output(),
            "chown",
        );
    }
    dir
}

/// A free loopback port below the kernel's ephemeral range (32768 and up by default), which
/// the suite's outgoing connections take their local ports from, and so could take this one
/// between the check and the start.
fn free_port() -> u16 {
    loop {
        let port = fastrand::u16(12_000..19_990);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            break port;
        }
    }
}

/// `program` as the `postgres` user when this runs as root.
fn as_owner(program: &str) -> Command {
    if as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--", program]);
        command
    } else {
        Command::new(program)
    }
}

/// Runs `sql` in the database at `url` with psql, and gives what it printed (unaligned,
/// tuples only).
///
/// # Panics
///
/// When psql is missing or the statement fails, with what it said.
pub(crate) fn psql(url: &str, sql: &str) -> String {
    let output = Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql])
        .output()
        .expect(
            "psql is missing: the PostgreSQL tests need the client and a server on \
             127.0.0.1:5432 with trust authentication (apt-get install postgresql)",
        );
    assert!(
        output.status.success(),
        "psql failed on {sql:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.starts_with(b"0\n"))
}

fn check(output: std::io::Result<Output>, what: &str) {
    if let Err(error) = succeeded(output, what) {
        panic!("{error}");
    }
}

/// Whether a program ran and succeeded; what it said otherwise.
fn succeeded(output: std::io::Result<Output>, what: &str) -> Result<(), String> {
    let output = output.map_err(|e| format!("{what}: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}
