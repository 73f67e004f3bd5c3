//! What a Redis server says of its own work: `INFO commandstats` (calls and time per
//! command) and `INFO cpu` (its main thread's CPU time), read over a connection of the
//! bench's own, so that the lock's connections and pools are left alone.

use std::collections::BTreeMap;

use redis::aio::MultiplexedConnection;

pub(crate) fn redis_error(error: redis::RedisError) -> String {
    error.to_string()
}

/// A connection of its own to the server (or cluster node) at `url`, for its statistics.
pub(crate) async fn connect(url: &str) -> Result<MultiplexedConnection, String> {
    redis::Client::open(url)
        .map_err(redis_error)?
        .get_multiplexed_async_connection()
        .await
        .map_err(redis_error)
}

pub(crate) async fn reset_stats(conn: &mut impl redis::aio::ConnectionLike) -> Result<(), String> {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(conn)
        .await
        .map_err(redis_error)
}

pub(crate) type CommandStats = BTreeMap<String, BTreeMap<String, f64>>;

/// `INFO commandstats` by command: `cmdstat_evalsha:calls=4,usec=120,...`.
pub(crate) async fn command_stats(
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<CommandStats, String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    Ok(info
        .lines()
        .filter_map(|line| line.trim().strip_prefix("cmdstat_"))
        .filter_map(|line| line.split_once(':'))
        .map(|(command, fields)| {
            let fields = fields
                .split(',')
                .filter_map(|field| field.split_once('='))
                .filter_map(|(name, value)| Some((name.to_owned(), value.parse().ok()?)))
                .collect();
            (command.to_owned(), fields)
        })
        .collect())
}

/// The CPU time (s, user + system) of Redis's main thread so far, from `INFO cpu`: the
/// thread that runs every command, with what `INFO commandstats` does not count (reading
/// and parsing commands, writing replies).
pub(crate) async fn main_thread_cpu(
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<f64, String> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
            .and_then(|value| value.parse::<f64>().ok())
            .ok_or_else(|| format!("INFO cpu has no {name}"))
    };
    Ok(field("used_cpu_user_main_thread")? + field("used_cpu_sys_main_thread")?)
}

/// The `usec` and `calls` of `commands`, summed.
pub(crate) fn sum(stats: &CommandStats, commands: &[&str]) -> (u64, u64) {
    let (mut usec, mut calls) = (0, 0);
    for command in commands {
        if let Some(stat) = stats.get(*command) {
            usec += stat.get("usec").copied().unwrap_or(0.0) as u64;
            calls += stat.get("calls").copied().unwrap_or(0.0) as u64;
        }
    }
    (usec, calls)
}
