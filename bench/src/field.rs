//! One key, locked and unlocked, against the field: the `rslock` crate (Redlock) on one
//! node and on three, next to this crate's single-key cycle on one Redis and on three
//! Redlock masters.
//!
//! rslock's cycle is `LockManager::lock(resource, ttl)` then `unlock(&lock)`; this crate's
//! is one request through `locks.layer(..)` (acquire, an empty handler, release), which
//! does a little more: the HTTP service around it, a fencing token, and a release message
//! for waiters.

use std::{sync::Arc, time::Duration};
use tower_batch_lock::store::{Redis, Redlock};

use deadpool_redis::Pool;
use rslock::LockManager;
use serde_json::{json, Value};
use tower_batch_lock::Locks;

use crate::{
    batch::{self, BatchService},
    progress,
    stats::{self, Budget, Summary},
    support::RedisServer,
    target::Target,
};

const TTL: Duration = Duration::from_secs(30);
const WARMUP: u64 = 50;
/// How many turns the cases take, each with a fifth of a case's budget.
const TURNS: u64 = 5;

enum Contender {
    Layer(BatchService),
    Rslock(LockManager),
}

impl Contender {
    async fn cycle(&self) -> Result<(), String> {
        match self {
            Self::Layer(service) => batch::call(service.clone()).await,
            Self::Rslock(manager) => {
                let lock = manager
                    .lock(b"bench:field".as_slice(), TTL)
                    .await
                    .map_err(|e| format!("rslock: {e:?}"))?;
                manager.unlock(&lock).await;
                Ok(())
            }
        }
    }
}

pub(crate) async fn run(pool: &Pool, single: &RedisServer, quick: bool) -> Result<Value, String> {
    // Three independent masters, as Redlock wants them.
    let trio: Vec<RedisServer> =
        tokio::task::spawn_blocking(|| (0..3).map(|_| RedisServer::start()).collect::<Vec<_>>())
            .await
            .map_err(|e| e.to_string())?;
    let trio_urls: Vec<String> = trio.iter().map(RedisServer::url).collect();

    let one_key: Arc<[String]> = Arc::from(vec!["bench:field".to_owned()]);
    let layer_one_node = batch::layered(
        &Locks::new(Redis::pool(pool.clone()).build().unwrap()).ttl(TTL),
        one_key.clone(),
    );
    let contenders: Vec<(&str, usize, Contender)> = vec![
        ("tower-batch-lock", 1, Contender::Layer(layer_one_node)),
        (
            "rslock",
            1,
            Contender::Rslock(LockManager::new(vec![single.url()])),
        ),
        (
            "rslock",
            3,
            Contender::Rslock(LockManager::new(trio_urls.clone())),
        ),
        (
            "tower-batch-lock Redlock",
            3,
            Contender::Layer(batch::layered(
                &Redlock::new(&trio_urls)
                    .build()
                    .map(Locks::new)
                    .map_err(|e| e.to_string())?
                    .ttl(TTL),
                one_key,
            )),
        ),
    ];

    // The cases take turns, a slice of each budget at a time, so that a slow moment of the
    // machine weighs on every case alike: one case after the other, rslock's median moved
    // from 185 to 115 µs between two runs.
    let time = if quick {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(3)
    };
    let budget = Budget {
        min: 10 / TURNS,
        max: 20_000 / TURNS,
        time: time / TURNS as u32,
    };
    let total = contenders.len();
    for (_, _, contender) in &contenders {
        for _ in 0..WARMUP {
            contender.cycle().await?;
        }
    }
    let mut samples = vec![Vec::new(); total];
    for turn in 1..=TURNS {
        for (index, (name, nodes, contender)) in contenders.iter().enumerate() {
            progress::begin(
                format!(
                    "field {}/{total} {name}, {nodes} node(s), 1 key (turn {turn}/{TURNS})",
                    index + 1
                ),
                "cycles",
                budget.max,
            );
            let taken = stats::rounds(budget, |_| async {
                let started = std::time::Instant::now();
                contender.cycle().await?;
                Ok(started.elapsed())
            })
            .await?;
            progress::end(&format!("{} cycles", taken.len()));
            samples[index].extend(taken);
        }
    }
    let mut cases = Vec::new();
    for ((name, nodes, _), samples) in contenders.iter().zip(samples) {
        let summary = Summary::of(samples);
        let mut case = json!({ "library": name, "nodes": nodes, "keys": 1 });
        if let (Value::Object(case), Value::Object(summary)) = (&mut case, summary.to_json()) {
            case.extend(summary);
        }
        cases.push(case);
    }
    drop(trio);

    let median = |library: &str, nodes: u64| {
        cases
            .iter()
            .find(|c| c["library"] == library && c["nodes"] == nodes)
            .and_then(|c| c["median_ms"].as_f64())
    };
    let ours = median("tower-batch-lock", 1);
    let rslock_one_node = median("rslock", 1);
    let ratios = json!({
        "rslock_1_node_over_ours_1_node": ours.zip(rslock_one_node).map(|(o, t)| stats::round(t / o, 3)),
        "rslock_3_nodes_over_ours_1_node": ours.zip(median("rslock", 3)).map(|(o, t)| stats::round(t / o, 3)),
        "rslock_3_nodes_over_ours_redlock_3_nodes": median("tower-batch-lock Redlock", 3).zip(median("rslock", 3)).map(|(o, t)| stats::round(t / o, 3)),
    });
    Ok(json!({
        "method": "single-key lock + unlock; rslock: LockManager::lock then unlock; tower-batch-lock: one request through the layer (acquire, empty handler, release); the cases take turns, five slices of each case's budget (3 s), and a case's figures are over all its slices",
        "cases": cases,
        "ratios": ratios,
        "targets": [Target::at_most(
            "1-key cycle: crate / rslock (1 node)",
            ours.zip(rslock_one_node).map(|(ours, theirs)| ours / theirs),
            1.0,
        )
        .to_json()],
    }))
}
