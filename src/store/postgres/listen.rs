//! What the PostgreSQL store runs beside its calls: a connection that `LISTEN`s for other
//! processes' releases and wakes this process's waiters, and a sweeper of the rows that
//! nobody holds or reserves any more. Both end once the store is dropped (`alive` gone).

use std::{sync::Weak, time::Duration};

use deadpool_postgres::Pool;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::{
    types::{ToSql, Type},
    AsyncMessage,
};

use super::tls::Connector;
use crate::store::{
    failing::{Failing, Lines},
    message::{wake_from_message, Reconnecting},
    wake::Wakeups,
};

/// How often the sweeper looks for dead rows.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Rows a sweep deletes at most in one statement.
const SWEEP_BATCH: i32 = 1000;

/// Sets the TCP keepalive of the store's connections: a server that vanished without
/// closing them (a network partition, a host gone) would go unnoticed by an idle
/// connection for the system's keepalive time, two hours by default. The kernel probes one
/// after 10 s idle, every 5 s, and gives it up after 3 unanswered probes (about 25 s).
pub(super) fn keep_alive(config: &mut tokio_postgres::Config) {
    config
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3);
}

/// Wakes this process's waiters for every release notified on `channel`, until the store
/// is dropped. Reconnects after a lost connection, and then wakes every waiter: releases in
/// the gap went unheard. Waiters poll meanwhile, as they do without a listener.
///
/// Once it listens, the connection only receives, so a server that vanished without
/// closing it would go unnoticed for the system's TCP keepalive time ([`keep_alive`]).
pub(super) async fn listen_for_releases(
    mut config: tokio_postgres::Config,
    connector: Connector,
    channel: String,
    wakeups: Weak<Wakeups>,
) {
    keep_alive(&mut config);
    // A port for each host, one for all, or none (5432).
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let at = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| match host {
            tokio_postgres::config::Host::Tcp(host) => format!("{host}:{}", port(i)),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(path) => format!("{}:{}", path.display(), port(i)),
        });
    let mut reconnecting = Reconnecting::new(at.collect::<Vec<_>>().join(","));
    while wakeups.strong_count() > 0 {
        match connector.connect(config.clone()).await {
            Ok((client, mut messages)) => {
                // The connection delivers notifications to whoever polls it, which also
                // drives the client's own statements.
                let (sender, mut notifications) = mpsc::unbounded_channel();
                let driver = tokio::spawn(async move {
                    while let Some(Ok(message)) = messages.next().await {
                        if let AsyncMessage::Notification(notification) = message {
                            if sender.send(notification).is_err() {
                                return;
                            }
                        }
                    }
                });
                match client.batch_execute(&format!("LISTEN \"{channel}\"")).await {
                    Ok(()) => {
                        reconnecting.listening();
                        if let Some(wakeups) = wakeups.upgrade() {
                            wakeups.wake_all();
                        }
                        loop {
                            // Wake up now and then to notice that the store is gone.
                            let next =
                                tokio::time::timeout(Duration::from_secs(1), notifications.recv());
                            match next.await {
                                Ok(Some(notification)) => {
                                    let Some(wakeups) = wakeups.upgrade() else {
                                        return;
                                    };
                                    wake_from_message(&wakeups, notification.payload().as_bytes());
                                }
                                Ok(None) => break,
                                Err(_) if wakeups.strong_count() == 0 => return,
                                Err(_) => {}
                            }
                        }
                        reconnecting.failed(&"lost the connection");
                    }
                    Err(error) => reconnecting.failed(&error),
                }
                driver.abort();
            }
            Err(error) => reconnecting.failed(&error),
        }
        reconnecting.pause().await;
    }
}

/// Deletes, every [`SWEEP_EVERY`], the rows that hold and reserve nothing any more (a
/// holder or a waiter that crashed, a release that was lost) and the expired answers, with
/// `sweep` (the schema's sweep function on a batch size), until the store is dropped.
/// Rows that a call is using are skipped, never waited for. A failure is logged (once
/// while its sweeps keep failing, [`Failing`], naming the table `at`), and the next sweep
/// tries again.
pub(super) async fn sweep(pool: Pool, sweep: String, at: String, alive: Weak<Wakeups>) {
    let mut failing = Failing::new(&SWEEPING, at);
    loop {
        // A second at a time: the task holds the pool (and its connections) until it
        // notices that the store is gone.
        for _ in 0..SWEEP_EVERY.as_secs() {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if alive.strong_count() == 0 {
                return;
            }
        }
        let swept = async {
            let client = pool.get().await?;
            // Unprepared, in one round trip, behind a pooler in transaction mode too; its
            // cost does not matter every 30 s. Until a batch comes back short: every dead
            // row goes, a batch at a time.
            let batch: [(&(dyn ToSql + Sync), Type); 1] = [(&SWEEP_BATCH, Type::INT4)];
            while client
                .query_typed(&sweep, &batch)
                .await?
                .first()
                .map_or(0, |row| row.get::<_, i32>(0))
                >= SWEEP_BATCH
            {}
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        };
        match swept.await {
            Ok(()) => failing.succeeded(),
            Err(error) => failing.failed(&error),
        }
    }
}

static SWEEPING: Lines = Lines {
    failed: "could not sweep the dead lock rows; trying again at the next sweep (further failures \
             are logged at debug level)",
    still: "still could not sweep the dead lock rows",
    back: "sweeping the dead lock rows again",
};
