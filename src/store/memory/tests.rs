//! The memory store's own checks, below the layer.

use super::*;
use crate::store::contract::{Modes, OwnerToken};

fn keys(names: &[&str]) -> Vec<String> {
    let mut keys: Vec<String> = names.iter().map(|n| format!("lock:{n}")).collect();
    keys.sort();
    keys
}

const TTL: Duration = Duration::from_secs(30);
/// How long a refused waiter's reservations last in these tests.
const RESERVATION: Duration = Duration::from_secs(1);

/// A new owner's first hold.
fn holder() -> Holder {
    Holder::new(OwnerToken::random())
}

/// `holder`'s acquisition of `keys` in `modes`, for `ttl`, naming up to `report` conflicts.
fn request(
    keys: &[String],
    modes: Modes,
    holder: Holder,
    ttl: Duration,
    report: usize,
    line: Line,
) -> AcquireRequest {
    AcquireRequest {
        namespace: "lock:".into(),
        keys: keys.into(),
        modes,
        holder,
        ttl,
        report,
        line,
        reserve: RESERVATION,
        retry: false,
    }
}

/// `holder`'s acquisition of `keys`, each in the mode `modes` gives.
fn attempt_in(
    store: &MemoryStore,
    keys: &[String],
    modes: Modes,
    holder: Holder,
    line: Line,
) -> Acquire {
    store.try_acquire(&request(keys, modes, holder, TTL, 20, line), Instant::now())
}

/// `holder`'s exclusive acquisition of `keys`.
fn attempt(
    store: &MemoryStore,
    keys: &[String],
    holder: Holder,
    ttl: Duration,
    report: usize,
    line: Line,
) -> Acquire {
    let exclusive = Modes::All(Mode::Exclusive);
    store.try_acquire(
        &request(keys, exclusive, holder, ttl, report, line),
        Instant::now(),
    )
}

fn granted(outcome: Acquire) -> bool {
    matches!(outcome, Acquire::Granted(_))
}

/// Whether `holder`, waiting in no line, is granted `keys`.
fn grants(store: &MemoryStore, keys: &[String], holder: Holder, ttl: Duration) -> bool {
    granted(attempt(store, keys, holder, ttl, 0, Line::Outside))
}

#[test]
fn overlapping_batch_is_refused_and_writes_nothing() {
    let store = MemoryStore::new();
    let (a, b) = (holder(), holder());
    assert!(granted(attempt(
        &store,
        &keys(&["1", "2"]),
        a,
        TTL,
        20,
        Line::Outside
    )));

    let Acquire::Held(c) = attempt(&store, &keys(&["2", "3", "4"]), b, TTL, 20, Line::Outside)
    else {
        panic!("an overlapping batch was granted");
    };
    assert_eq!(c.keys, keys(&["2"]));
    assert_eq!(c.total, 1);
    assert!(c.earliest_expiry.is_some_and(|e| e <= TTL));
    // All or nothing: the free keys of the refused batch were not taken.
    assert_eq!(store.len(), 2);
    assert!(granted(attempt(
        &store,
        &keys(&["3", "4"]),
        b,
        TTL,
        20,
        Line::Outside
    )));
}

#[test]
fn release_only_deletes_the_owners_keys() {
    let store = MemoryStore::new();
    let (a, b) = (holder(), holder());
    assert!(granted(attempt(
        &store,
        &keys(&["1"]),
        a,
        TTL,
        20,
        Line::Outside
    )));
    assert_eq!(store.release_owned(&keys(&["1"]), b, Instant::now()), 0);
    assert!(matches!(
        attempt(&store, &keys(&["1"]), b, TTL, 20, Line::Outside),
        Acquire::Held(_)
    ));
    assert_eq!(store.release_owned(&keys(&["1"]), a, Instant::now()), 1);
    assert_eq!(
        store.release_owned(&keys(&["1"]), a, Instant::now()),
        0,
        "release is idempotent"
    );
    assert!(granted(attempt(
        &store,
        &keys(&["1"]),
        b,
        TTL,
        20,
        Line::Outside
    )));
}

#[test]
fn expired_keys_are_free_and_cannot_be_released_by_their_old_owner() {
    let store = MemoryStore::new();
    let (a, b) = (holder(), holder());
    let short = Duration::from_millis(20);
    assert!(granted(attempt(
        &store,
        &keys(&["1"]),
        a,
        short,
        20,
        Line::Outside
    )));
    std::thread::sleep(short * 2);
    assert!(granted(attempt(
        &store,
        &keys(&["1"]),
        b,
        TTL,
        20,
        Line::Outside
    )));
    assert_eq!(store.release_owned(&keys(&["1"]), a, Instant::now()), 0);
    assert!(matches!(
        attempt(&store, &keys(&["1"]), a, TTL, 20, Line::Outside),
        Acquire::Held(_)
    ));
}

#[test]
fn contention_names_at_most_the_report_limit_but_counts_all() {
    let store = MemoryStore::new();
    let names: Vec<String> = (0..50).map(|i| i.to_string()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let batch = keys(&names);
    assert!(granted(attempt(
        &store,
        &batch,
        holder(),
        TTL,
        20,
        Line::Outside
    )));
    let Acquire::Held(c) = attempt(&store, &batch, holder(), TTL, 3, Line::Outside) else {
        panic!("granted twice");
    };
    assert_eq!((c.keys.len(), c.total), (3, 50));
}

#[test]
fn expired_entries_are_swept_as_the_map_grows() {
    let store = MemoryStore::new();
    let short = Duration::from_millis(1);
    for i in 0..(SHARDS * FIRST_SWEEP_AT) {
        let key = vec![format!("lock:{i}")];
        assert!(grants(&store, &key, holder(), short));
    }
    std::thread::sleep(Duration::from_millis(5));
    for i in 0..(SHARDS * FIRST_SWEEP_AT) {
        let key = vec![format!("again:{i}")];
        assert!(grants(&store, &key, holder(), TTL));
    }
    // Without sweeping all 2 * 65,536 entries would remain.
    assert!(
        store.len() < 2 * SHARDS * FIRST_SWEEP_AT * 3 / 4,
        "{}",
        store.len()
    );
}

#[test]
fn extend_needs_every_key_still_held_by_the_owner() {
    let store = MemoryStore::new();
    let (a, b) = (holder(), holder());
    let short = Duration::from_millis(30);
    assert!(grants(&store, &keys(&["1", "2"]), a, short));
    assert!(
        !store.try_extend(&keys(&["1", "2"]), b, TTL),
        "a foreign owner extended"
    );
    assert!(store.try_extend(&keys(&["1", "2"]), a, TTL));
    std::thread::sleep(short * 2);
    // Extended past the original expiry: still held.
    assert!(!grants(&store, &keys(&["2"]), b, TTL));

    assert_eq!(store.release_owned(&keys(&["2"]), a, Instant::now()), 1);
    assert!(
        !store.try_extend(&keys(&["1", "2"]), a, TTL),
        "extended a partly lost lease"
    );
}

#[test]
fn fencing_tokens_increase_with_every_grant() {
    // The token of a new owner's grant of `key` on `store`.
    let fence = |store: &MemoryStore, key: &str| match attempt(
        store,
        &keys(&[key]),
        holder(),
        TTL,
        0,
        Line::Outside,
    ) {
        Acquire::Granted(token) => token,
        Acquire::Held(_) => panic!("refused"),
    };
    let store = MemoryStore::new();
    let first = fence(&store, "1");
    let second = fence(&store, "2");
    assert_eq!(second.get(), first.get() + 1);

    // A store made later, as after a restart of the process, starts above every token the
    // first one handed out: its counter starts at the clock's floor.
    for i in 0..100 {
        fence(&store, &format!("more:{i}"));
    }
    std::thread::sleep(Duration::from_millis(2));
    let restarted = MemoryStore::new();
    let after = fence(&restarted, "1");
    assert!(after.get() > second.get() + 100, "{after} after {second}");
}

#[test]
fn an_owner_reenters_its_keys_and_frees_them_with_its_last_hold() {
    let store = MemoryStore::new();
    let outer = holder();
    let inner = Holder::new(outer.owner);
    let stranger = holder();
    assert!(grants(&store, &keys(&["1"]), outer, TTL));
    // Re-entry, with a new key in the same batch: granted, not contended.
    assert!(grants(&store, &keys(&["1", "2"]), inner, TTL));
    assert!(!grants(&store, &keys(&["1"]), stranger, TTL));

    // The inner release keeps the outer hold, and is harmless twice.
    assert_eq!(
        store.release_owned(&keys(&["1", "2"]), inner, Instant::now()),
        2
    );
    assert_eq!(
        store.release_owned(&keys(&["1", "2"]), inner, Instant::now()),
        0
    );
    assert!(!grants(&store, &keys(&["1"]), stranger, TTL));
    assert!(grants(&store, &keys(&["2"]), stranger, TTL));

    // The outermost release frees the key.
    assert_eq!(store.release_owned(&keys(&["1"]), outer, Instant::now()), 1);
    assert!(grants(&store, &keys(&["1"]), stranger, TTL));
}

#[test]
fn reentry_never_shortens_a_lease_and_extends_only_its_own_hold() {
    let store = MemoryStore::new();
    let outer = holder();
    let inner = Holder::new(outer.owner);
    let short = Duration::from_millis(20);
    assert!(grants(&store, &keys(&["1"]), outer, TTL));
    assert!(grants(&store, &keys(&["1"]), inner, short));
    std::thread::sleep(short * 2);
    assert!(
        !grants(&store, &keys(&["1"]), holder(), TTL),
        "re-entry shortened the lease"
    );
    assert!(store.try_extend(&keys(&["1"]), inner, TTL));
    assert_eq!(store.release_owned(&keys(&["1"]), inner, Instant::now()), 1);
    assert!(
        !store.try_extend(&keys(&["1"]), inner, TTL),
        "extended a released hold"
    );
    assert!(store.try_extend(&keys(&["1"]), outer, TTL));
}

const SHARED: Modes = Modes::All(Mode::Shared);

#[test]
fn shared_holds_admit_each_other_and_no_exclusive_hold() {
    let store = MemoryStore::new();
    let batch = keys(&["a", "b"]);
    let (r1, r2, w) = (holder(), holder(), holder());
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        r1,
        Line::Outside
    )));
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        r2,
        Line::Outside
    )));
    let view = store.view(&batch);
    assert!(view
        .iter()
        .all(|v| v.status == KeyStatus::Shared && v.holds == 2));
    // A writer is refused, and so is a batch that takes one key shared, one exclusively.
    assert!(!granted(attempt(
        &store,
        &batch[1..],
        w,
        TTL,
        20,
        Line::Outside
    )));
    let mixed = Modes::Each(vec![Mode::Shared, Mode::Exclusive].into());
    assert!(!granted(attempt_in(
        &store,
        &batch,
        mixed,
        w,
        Line::Outside
    )));
    // All or nothing: the refused mixed batch took nothing.
    assert!(store.view(&batch).iter().all(|v| v.holds == 2));
    // The last reader out frees the key for the writer.
    assert_eq!(store.release_owned(&batch, r1, Instant::now()), 2);
    assert!(!granted(attempt(&store, &batch, w, TTL, 20, Line::Outside)));
    assert_eq!(store.release_owned(&batch, r2, Instant::now()), 2);
    assert!(granted(attempt(&store, &batch, w, TTL, 20, Line::Outside)));
    // An exclusive hold keeps readers out.
    assert!(!granted(attempt_in(
        &store,
        &batch,
        SHARED,
        r1,
        Line::Outside
    )));
    assert_eq!(store.release_owned(&batch, w, Instant::now()), 2);
    assert_eq!(store.len(), 0);
}

#[test]
fn an_upgrade_is_granted_to_a_sole_reader_only_and_refused_at_once_otherwise() {
    let store = MemoryStore::new();
    let batch = keys(&["a"]);
    let owner = OwnerToken::random();
    let (read, write) = (Holder::new(owner), Holder::new(owner));
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        read,
        Line::Holder(Ticket::take())
    )));
    // Alone: the owner takes its key exclusively, and keeps both holds.
    assert!(granted(attempt(
        &store,
        &batch,
        write,
        TTL,
        20,
        Line::Holder(Ticket::take())
    )));
    assert_eq!(store.view(&batch)[0].status, KeyStatus::Held);
    assert!(!granted(attempt_in(
        &store,
        &batch,
        SHARED,
        holder(),
        Line::Outside
    )));
    // Its exclusive hold ended, the key is shared again: another reader comes in.
    assert_eq!(store.release_owned(&batch, write, Instant::now()), 1);
    let view = store.view(&batch);
    assert_eq!((view[0].status, view[0].holds), (KeyStatus::Shared, 1));
    let beside = holder();
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        beside,
        Line::Outside
    )));
    assert_eq!(store.release_owned(&batch, beside, Instant::now()), 1);
    assert_eq!(store.release_owned(&batch, read, Instant::now()), 1);

    // With another reader: contention that says it is an upgrade.
    let other = holder();
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        read,
        Line::Holder(Ticket::take())
    )));
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        other,
        Line::Outside
    )));
    let Acquire::Held(refused) =
        attempt(&store, &batch, write, TTL, 20, Line::Holder(Ticket::take()))
    else {
        panic!("an upgrade over another reader was granted");
    };
    assert!(refused.upgrade);
    // A writer that holds the key exclusively takes it shared freely.
    assert_eq!(
        store.release_owned(&batch, read, Instant::now())
            + store.release_owned(&batch, other, Instant::now()),
        2
    );
    assert!(granted(attempt(
        &store,
        &batch,
        write,
        TTL,
        20,
        Line::Holder(Ticket::take())
    )));
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        read,
        Line::Holder(Ticket::take())
    )));
    assert_eq!(store.view(&batch)[0].holds, 2);
}

#[test]
fn a_waiting_writers_reservation_keeps_new_readers_out() {
    let store = MemoryStore::new();
    let batch = keys(&["a"]);
    let (reader, writer) = (holder(), holder());
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        reader,
        Line::Outside
    )));
    let ticket = Ticket::take();
    assert!(!granted(attempt(
        &store,
        &batch,
        writer,
        TTL,
        20,
        Line::At(ticket)
    )));
    // A later reader, in line or not, waits behind the writer.
    assert!(!granted(attempt_in(
        &store,
        &batch,
        SHARED,
        holder(),
        Line::Outside
    )));
    let later = Line::At(Ticket::take());
    assert!(!granted(attempt_in(
        &store,
        &batch,
        SHARED,
        holder(),
        later
    )));
    // The reader that was there first re-enters its own key freely, and its end lets the
    // writer in.
    let again = Holder::new(reader.owner);
    assert!(granted(attempt_in(
        &store,
        &batch,
        SHARED,
        again,
        Line::Holder(Ticket::take())
    )));
    store.release_owned(&batch, again, Instant::now());
    store.release_owned(&batch, reader, Instant::now());
    assert!(granted(attempt(
        &store,
        &batch,
        writer,
        TTL,
        20,
        Line::At(ticket)
    )));
}

#[test]
fn a_shared_hold_renews_and_expires_on_its_own() {
    let store = MemoryStore::new();
    let batch = keys(&["a"]);
    let (short, long) = (holder(), holder());
    let shared_for = |holder, ttl| request(&batch, SHARED, holder, ttl, 20, Line::Outside);
    assert!(granted(store.try_acquire(
        &shared_for(short, Duration::from_millis(40)),
        Instant::now()
    )));
    assert!(granted(
        store.try_acquire(&shared_for(long, TTL), Instant::now())
    ));
    // Extending one hold leaves the other's expiry alone.
    assert!(store.try_extend(&batch, long, TTL));
    std::thread::sleep(Duration::from_millis(60));
    assert!(!store.try_extend(&batch, short, TTL), "its own ttl ran out");
    assert!(
        store.try_extend(&batch, long, TTL),
        "the other reader's hold is intact"
    );
    let view = store.view(&batch);
    assert_eq!((view[0].status, view[0].holds), (KeyStatus::Shared, 1));
    assert_eq!(store.release_owned(&batch, long, Instant::now()), 1);
    assert_eq!(store.len(), 0);
}
