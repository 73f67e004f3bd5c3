//! The benchmarks of tower-batch-lock: against its baselines, the field, and Redis's own
//! time for its work. One command regenerates every figure:
//!
//! ```sh
//! cargo run --release --manifest-path bench/Cargo.toml            # every section
//! cargo run --release --manifest-path bench/Cargo.toml -- http    # some: batch field http wake mixed cluster shared contention fenced postgres
//! cargo run --release --manifest-path bench/Cargo.toml -- --quick # a short smoke run
//! cargo run --release --manifest-path bench/Cargo.toml -- contention --only "PostgreSQL, hot"
//! ```
//!
//! It starts its own `redis-server` processes (and, for the PostgreSQL figures, a
//! PostgreSQL server: `initdb` and `pg_ctl`, as the `postgres` user when run as root) on
//! free loopback ports, writes
//! `docs/bench/results.json` and `docs/bench/cost-per-key.svg`, rewrites the tables between
//! the bench markers of `docs/bench/README.md`, shows its progress on stderr, and prints the tables
//! with every target and its measured ratio on stdout. Sections not run keep their figures
//! from the previous `results.json`. `--quick` writes under `bench/target/quick/` instead
//! and leaves the tables alone. `--only <text>` (once or more) runs the contention cases
//! whose "store, level" contains one of the texts, at full length, for an A/B of one store
//! or level: it writes under `bench/target/only/` and leaves the tables alone, as a run
//! that lacks cases must.

// The test harness's real redis-server processes on free loopback ports. `rustfmt::skip`:
// the crate's own `cargo fmt` formats that file, not this package's.
#[allow(dead_code)] // the tests use more of it than the bench
#[path = "../../tests/it/support/server.rs"]
#[rustfmt::skip]
mod support;

// The tests' PostgreSQL server of its own (initdb, pg_ctl), shared the same way.
#[allow(dead_code)]
#[path = "../../tests/it/support/pg_server.rs"]
#[rustfmt::skip]
mod pg_support;

// The tests' Redis Cluster (three masters, here without replicas), shared the same way.
#[allow(dead_code)]
#[path = "../../tests/it/support/cluster.rs"]
#[rustfmt::skip]
mod cluster_support;
// The name the cluster's file knows the servers' one by (a sibling in the tests).
use support as server;

mod batch;
mod cluster;
mod contention;
mod fenced;
mod field;
mod http;
mod load;
mod mixed;
mod plot;
mod postgres;
mod progress;
mod redis_info;
mod report;
mod shared;
mod stats;
mod target;
mod wake;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Instant, SystemTime},
};

use serde_json::{json, Map, Value};

/// The sections, in the order of the results. They run in this order, except http, which
/// runs last (see [`run_sections`]).
const SECTIONS: [&str; 10] = [
    "batch",
    "field",
    "http",
    "wake",
    "mixed",
    "cluster",
    "shared",
    "contention",
    "fenced",
    "postgres",
];

const COMMAND: &str = "cargo run --release --manifest-path bench/Cargo.toml";

struct Options {
    sections: Vec<&'static str>,
    quick: bool,
    /// The contention cases to run, by part of their "store, level"; empty: all.
    only: Vec<String>,
}

impl Options {
    /// Where the results go: the committed ones only from a run that has them all.
    fn out_dir(&self, root: &Path) -> PathBuf {
        match (self.quick, self.only.is_empty()) {
            (true, _) => root.join("bench/target/quick"),
            (false, false) => root.join("bench/target/only"),
            (false, true) => root.join("docs/bench"),
        }
    }

    /// Whether the run writes the committed results and tables.
    fn committed(&self) -> bool {
        !self.quick && self.only.is_empty()
    }
}

fn options() -> Result<Options, String> {
    let mut sections = Vec::new();
    let mut quick = false;
    let mut only = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--only" => match args.next() {
                Some(text) => only.push(text),
                None => return Err("--only needs a text: a part of \"store, level\"".to_owned()),
            },
            "-h" | "--help" => {
                return Err(format!(
                    "usage: {COMMAND} [-- [--quick] [--only <store, level>]... [{}]...]",
                    SECTIONS.join("|")
                ))
            }
            name => match SECTIONS.iter().find(|s| **s == name) {
                Some(section) => sections.push(*section),
                None => return Err(format!("unknown section {name:?}; sections: {SECTIONS:?}")),
            },
        }
    }
    if sections.is_empty() {
        sections = SECTIONS.to_vec();
    }
    if !only.is_empty() && !sections.contains(&"contention") {
        return Err("--only chooses cases of the contention section: name it too".to_owned());
    }
    sections.sort_by_key(|s| SECTIONS.iter().position(|x| x == s));
    sections.dedup();
    Ok(Options {
        sections,
        quick,
        only,
    })
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("bench/ lives in the repository")
        .to_path_buf()
}

fn main() -> ExitCode {
    let options = match options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::FAILURE;
        }
    };
    progress::start();
    let started = Instant::now();
    let root = repo_root();
    let out_dir = options.out_dir(&root);
    let results_path = out_dir.join("results.json");

    progress::note("starting redis-server on a free loopback port");
    let server = support::RedisServer::start();
    let postgres = ["postgres", "contention", "mixed"]
        .iter()
        .any(|s| options.sections.contains(s))
        .then(|| {
            progress::note("starting PostgreSQL on a free loopback port");
            pg_support::PgServer::start()
        });
    let runtime = tokio::runtime::Runtime::new().expect("a Tokio runtime");
    let pg_url = postgres.as_ref().map(pg_support::PgServer::url);
    let (sections, failures) = runtime.block_on(run_sections(&server, pg_url.as_deref(), &options));
    drop(runtime);

    let mut results = previous(&results_path, &options);
    let fresh = results.is_empty();
    for (name, value) in sections {
        results.insert(name.to_owned(), value);
    }
    let redis_version = redis_version(&server);
    drop(server);
    let mut document = json!({
        "command": command_line(&options),
        "date": utc_now(),
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu_model(),
        "redis_version": redis_version,
        "sections_run": options.sections,
        "wall_seconds": stats::round(started.elapsed().as_secs_f64(), 1),
    });
    let document_map = document.as_object_mut().expect("an object");
    if !fresh && options.sections.len() < SECTIONS.len() {
        document_map.insert(
            "note".to_owned(),
            json!("sections not in sections_run keep the figures of an earlier run"),
        );
    }
    for section in SECTIONS {
        if let Some(value) = results.remove(section) {
            document_map.insert(section.to_owned(), value);
        }
    }
    let targets: Vec<Value> = SECTIONS
        .iter()
        .filter_map(|s| document_map.get(*s)?.get("targets")?.as_array().cloned())
        .flatten()
        .collect();
    document_map.insert("targets".to_owned(), Value::Array(targets));

    if let Err(error) = write_outputs(&document, &out_dir, &root, options.committed()) {
        eprintln!("could not write the results: {error}");
        return ExitCode::FAILURE;
    }
    println!("{}", report::markdown(&document));
    progress::note(&format!(
        "done in {:.0} s: {} written",
        started.elapsed().as_secs_f64(),
        results_path.display()
    ));
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        for failure in failures {
            eprintln!("FAILED: {failure}");
        }
        ExitCode::FAILURE
    }
}

/// `postgres`: the URL of the bench's PostgreSQL, started when a section needs it.
async fn run_sections(
    server: &support::RedisServer,
    postgres: Option<&str>,
    options: &Options,
) -> (Vec<(&'static str, Value)>, Vec<String>) {
    let postgres = postgres.unwrap_or_default();
    let pool = pool(&server.url());
    let mut done = Vec::new();
    let mut failures = Vec::new();
    // http installs a global metrics recorder, which cannot be uninstalled: it runs last, so
    // that no other section records through it.
    let mut order = options.sections.clone();
    order.sort_by_key(|section| *section == "http");
    for section in &order {
        let started = Instant::now();
        progress::note(&format!("section {section}"));
        let result = match *section {
            "batch" => batch::run(&pool, options.quick).await,
            "field" => field::run(&pool, server, options.quick).await,
            "http" => http::run(&pool, options.quick).await,
            "wake" => wake::run(server, options.quick).await,
            "mixed" => mixed::run(server, postgres, options.quick).await,
            "cluster" => cluster::run(server, &pool, options.quick).await,
            "shared" => shared::run(server, options.quick).await,
            "contention" => contention::run(server, postgres, options.quick, &options.only).await,
            "fenced" => fenced::run(&pool, options.quick).await,
            "postgres" => postgres::run(postgres, options.quick).await,
            _ => unreachable!("sections are checked when parsed"),
        };
        match result {
            Ok(mut value) => {
                if let Some(map) = value.as_object_mut() {
                    map.insert(
                        "wall_seconds".to_owned(),
                        json!(stats::round(started.elapsed().as_secs_f64(), 1)),
                    );
                }
                done.push((*section, value));
            }
            Err(error) => {
                progress::note(&format!("section {section} failed: {error}"));
                failures.push(format!("{section}: {error}"));
            }
        }
    }
    (done, failures)
}

/// The bench's pool. redis-rs gives up on a reply after 500 ms by default, and one script
/// over 100,000 keys runs for about that long: the pool waits up to 30 s instead, and the
/// crate's own `backend_timeout` bounds each call.
fn pool(url: &str) -> deadpool_redis::Pool {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
    let manager = deadpool_redis::Manager::new_with_config(url, config).expect("a valid Redis URL");
    deadpool_redis::Pool::builder(manager)
        .runtime(deadpool_redis::Runtime::Tokio1)
        .build()
        .expect("a pool")
}

const RESPONSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The sections of the last results, kept when only some sections run now.
fn previous(path: &Path, options: &Options) -> Map<String, Value> {
    if options.sections.len() == SECTIONS.len() {
        return Map::new();
    }
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
        .and_then(|value| value.as_object().cloned())
        .map(|mut all| {
            all.retain(|key, _| SECTIONS.contains(&key.as_str()));
            all
        })
        .unwrap_or_default()
}

/// `committed`: whether the run rewrites the README's tables.
fn write_outputs(
    document: &Value,
    out_dir: &Path,
    root: &Path,
    committed: bool,
) -> Result<(), String> {
    std::fs::create_dir_all(out_dir).map_err(|e| e.to_string())?;
    let json = serde_json::to_string_pretty(document).map_err(|e| e.to_string())? + "\n";
    std::fs::write(out_dir.join("results.json"), json).map_err(|e| e.to_string())?;
    if let Some(batch) = document.get("batch") {
        plot::draw(batch, &out_dir.join("cost-per-key.svg"))?;
    }
    if committed {
        report::update_readme(&root.join("docs/bench/README.md"), document)?;
    }
    Ok(())
}

fn command_line(options: &Options) -> String {
    let mut command = COMMAND.to_owned();
    if !options.committed() || options.sections.len() < SECTIONS.len() {
        command.push_str(" --");
        if options.quick {
            command.push_str(" --quick");
        }
        for only in &options.only {
            command.push_str(&format!(" --only {only:?}"));
        }
        if options.sections.len() < SECTIONS.len() {
            for section in &options.sections {
                command.push(' ');
                command.push_str(section);
            }
        }
    }
    command
}

fn redis_version(server: &support::RedisServer) -> String {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut server.connection())
        .unwrap_or_default();
    info.lines()
        .find_map(|line| line.trim().strip_prefix("redis_version:"))
        .unwrap_or("unknown")
        .to_owned()
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Now, as `2026-11-22T01:23:45Z`.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's days-to-civil algorithm.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}
