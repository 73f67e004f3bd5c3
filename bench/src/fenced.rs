//! What a guarded write costs: `fenced::set` (one script that checks each key's last
//! token and writes the keys with theirs) beside the plain `MSET` it replaces, for 1 to
//! 2,000 keys (an order of the `orders` example writes a stock level a SKU and the
//! order). Both are one call; measured are the client's time a write, in rounds that
//! alternate the two, and Redis's main-thread CPU a write (`INFO cpu`), which grows with
//! the keys: the script reads a fence and writes two keys for each.
//!
//! On a Redis Cluster of three masters, `fenced::set_across_slots` (one read of every
//! fence, then one script a slot, all at once) beside the plain `MSET` that redis-rs splits
//! by slot, for an order's write (4 keys) and 100 keys, each key in a slot of its own.

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use axum::{body::Body, routing::post, Router};
use deadpool_redis::Pool;
use http::{request::Parts, Request};
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_batch_lock::{fenced, store::Store, FencingToken, Lease, Locks, Rejection};

use crate::{
    cluster_support::Cluster,
    progress,
    redis_info::{main_thread_cpu, redis_error},
    stats::{self, Summary},
};

/// A token of a real grant: the writes need one, and only grants make them.
async fn token() -> FencingToken {
    let seen = Arc::new(Mutex::new(None));
    let locks = Locks::new(Store::isolated_memory());
    let app = {
        let seen = seen.clone();
        Router::new().route(
            "/",
            post(move |lease: Lease| async move {
                *seen.lock().unwrap() = Some(lease.fencing_token());
            })
            .layer(locks.layer(|_: &Parts| Ok::<_, Rejection>(["bench:fenced"]))),
        )
    };
    let request = Request::post("/").body(Body::empty()).unwrap();
    app.oneshot(request).await.unwrap();
    let token = seen.lock().unwrap().take();
    token.expect("the handler ran")
}

pub(crate) async fn run(pool: &Pool, quick: bool) -> Result<Value, String> {
    let token = token().await;
    let mut redis = pool.get().await.map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    for keys in [1usize, 10, 100, 2_000] {
        let writes: Vec<(String, String)> = (0..keys)
            .map(|i| (format!("bench:fenced:{i}"), i.to_string()))
            .collect();
        let rounds = if quick { 20 } else { 200 }.min(200_000 / keys).max(10);
        let (mut plain, mut guarded) = (Vec::new(), Vec::new());
        let (mut plain_cpu, mut guarded_cpu) = (0.0, 0.0);
        for _ in 0..rounds {
            let mut mset = redis::cmd("MSET");
            for (key, value) in &writes {
                mset.arg(key).arg(value);
            }
            let before = main_thread_cpu(&mut *redis).await?;
            let started = Instant::now();
            let () = mset.query_async(&mut *redis).await.map_err(redis_error)?;
            plain.push(started.elapsed());
            plain_cpu += main_thread_cpu(&mut *redis).await? - before;

            let pairs: Vec<(&str, &str)> = writes
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let before = main_thread_cpu(&mut *redis).await?;
            let started = Instant::now();
            let written = fenced::set(&mut *redis, token, &pairs)
                .await
                .map_err(redis_error)?;
            guarded.push(started.elapsed());
            guarded_cpu += main_thread_cpu(&mut *redis).await? - before;
            if !written {
                return Err("a fenced write with one token was refused".to_owned());
            }
        }
        let (plain, guarded) = (Summary::of(plain), Summary::of(guarded));
        let cpu_us = |total: f64| stats::round(total / rounds as f64 * 1e6, 1);
        let ratio = stats::ms(guarded.median) / stats::ms(plain.median);
        progress::note(&format!(
            "fenced: {keys} keys, fenced::set {:.3} ms vs MSET {:.3} ms (x{ratio:.2})",
            stats::ms(guarded.median),
            stats::ms(plain.median)
        ));
        cases.push(json!({
            "keys": keys,
            "calls_per_write": {"mset": 1, "fenced_set": 1},
            "mset": plain.to_json(),
            "fenced_set": guarded.to_json(),
            "median_ratio": stats::round(ratio, 2),
            "redis_cpu_us_per_write": {"mset": cpu_us(plain_cpu), "fenced_set": cpu_us(guarded_cpu)},
        }));
    }
    let _: u64 = redis::cmd("DEL")
        .arg(
            (0..2_000)
                .flat_map(|i| {
                    let key = format!("bench:fenced:{i}");
                    [fenced::fence_key(&key), key]
                })
                .collect::<Vec<_>>(),
        )
        .query_async(&mut *redis)
        .await
        .map_err(redis_error)?;
    let cluster = across_slots(token, quick).await?;
    Ok(json!({ "cases": cases, "cluster": cluster }))
}

/// The cluster's cases: client time a write, fenced across slots and plain.
async fn across_slots(token: FencingToken, quick: bool) -> Result<Value, String> {
    progress::note("starting a Redis Cluster of three masters on free loopback ports");
    let cluster = tokio::task::spawn_blocking(|| Cluster::start_with(0))
        .await
        .map_err(|e| format!("the cluster did not start: {e}"))?;
    let client = redis::cluster::ClusterClient::new(cluster.urls()).map_err(redis_error)?;
    let mut data = client.get_async_connection().await.map_err(redis_error)?;
    let mut cases = Vec::new();
    for keys in [4usize, 100] {
        let writes: Vec<(String, String)> = (0..keys)
            .map(|i| (format!("bench:fenced:{i}"), i.to_string()))
            .collect();
        let pairs: Vec<(&str, &str)> = writes
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let slots: std::collections::HashSet<_> = writes
            .iter()
            .map(|(key, _)| redis::cluster_routing::Slot::for_key(key))
            .collect();
        let rounds = if quick { 20 } else { 200 };
        let (mut plain, mut guarded) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let mut mset = redis::cmd("MSET");
            for (key, value) in &writes {
                mset.arg(key).arg(value);
            }
            let started = Instant::now();
            let () = mset.query_async(&mut data).await.map_err(redis_error)?;
            plain.push(started.elapsed());

            let started = Instant::now();
            let written = fenced::set_across_slots(&mut data, token, &pairs)
                .await
                .map_err(redis_error)?;
            guarded.push(started.elapsed());
            if written != fenced::Written::All {
                return Err(format!("a fenced write with one token wrote {written:?}"));
            }
        }
        let (plain, guarded) = (Summary::of(plain), Summary::of(guarded));
        let ratio = stats::ms(guarded.median) / stats::ms(plain.median);
        progress::note(&format!(
            "fenced on a cluster: {keys} keys in {} slots, set_across_slots {:.3} ms vs MSET {:.3} ms (x{ratio:.2})",
            slots.len(),
            stats::ms(guarded.median),
            stats::ms(plain.median)
        ));
        cases.push(json!({
            "keys": keys,
            "slots": slots.len(),
            "calls_per_write": {"mset": "one MSET a slot, sent at once", "set_across_slots": "one MGET a slot, then one script a slot, each sent at once"},
            "mset": plain.to_json(),
            "set_across_slots": guarded.to_json(),
            "median_ratio": stats::round(ratio, 2),
        }));
    }
    Ok(json!({ "masters": cluster.masters().len(), "cases": cases }))
}
