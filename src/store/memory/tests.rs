//! The memory store's own checks, below the layer.

use super::*;

fn keys(names: &[&str]) -> Vec<String> {
    let mut keys: Vec<String> = names.iter().map(|n| format!("lock:{n}")).collect();
    keys.sort();
    keys
}

const TTL: Duration = Duration::from_secs(30);

/// A new owner's first hold.
fn holder() -> Holder {
    Holder::new(OwnerToken::random())
}

fn granted(outcome: Acquire) -> bool {
    matches!(outcome, Acquire::Granted(_))
}

/// Whether `holder`, waiting in no line, is granted `keys`.
fn grants(backend: &MemoryStore, keys: &[String], holder: Holder, ttl: Duration) -> bool {
    granted(backend.try_acquire(keys, holder, ttl, 0, Line::Outside))
}

#[test]
fn overlapping_batch_is_refused_and_writes_nothing() {
    let backend = MemoryStore::new();
    let (a, b) = (holder(), holder());
    assert!(granted(backend.try_acquire(
        &keys(&["1", "2"]),
        a,
        TTL,
        20,
        Line::Outside
    )));

    let Acquire::Held(c) = backend.try_acquire(&keys(&["2", "3", "4"]), b, TTL, 20, Line::Outside)
    else {
        panic!("an overlapping batch was granted");
    };
    assert_eq!(c.keys, keys(&["2"]));
    assert_eq!(c.total, 1);
    assert!(c.earliest_expiry.is_some_and(|e| e <= TTL));
    // All or nothing: the free keys of the refused batch were not taken.
    assert_eq!(backend.len(), 2);
    assert!(granted(backend.try_acquire(
        &keys(&["3", "4"]),
        b,
        TTL,
        20,
        Line::Outside
    )));
}

#[test]
fn release_only_deletes_the_owners_keys() {
    let backend = MemoryStore::new();
    let (a, b) = (holder(), holder());
    assert!(granted(backend.try_acquire(
        &keys(&["1"]),
        a,
        TTL,
        20,
        Line::Outside
    )));
    assert_eq!(backend.release_owned(&keys(&["1"]), b), 0);
    assert!(matches!(
        backend.try_acquire(&keys(&["1"]), b, TTL, 20, Line::Outside),
        Acquire::Held(_)
    ));
    assert_eq!(backend.release_owned(&keys(&["1"]), a), 1);
    assert_eq!(
        backend.release_owned(&keys(&["1"]), a),
        0,
        "release is idempotent"
    );
    assert!(granted(backend.try_acquire(
        &keys(&["1"]),
        b,
        TTL,
        20,
        Line::Outside
    )));
}

#[test]
fn expired_keys_are_free_and_cannot_be_released_by_their_old_owner() {
    let backend = MemoryStore::new();
    let (a, b) = (holder(), holder());
    let short = Duration::from_millis(20);
    assert!(granted(backend.try_acquire(
        &keys(&["1"]),
        a,
        short,
        20,
        Line::Outside
    )));
    std::thread::sleep(short * 2);
    assert!(granted(backend.try_acquire(
        &keys(&["1"]),
        b,
        TTL,
        20,
        Line::Outside
    )));
    assert_eq!(backend.release_owned(&keys(&["1"]), a), 0);
    assert!(matches!(
        backend.try_acquire(&keys(&["1"]), a, TTL, 20, Line::Outside),
        Acquire::Held(_)
    ));
}

#[test]
fn contention_names_at_most_the_report_limit_but_counts_all() {
    let backend = MemoryStore::new();
    let names: Vec<String> = (0..50).map(|i| i.to_string()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let batch = keys(&names);
    assert!(granted(backend.try_acquire(
        &batch,
        holder(),
        TTL,
        20,
        Line::Outside
    )));
    let Acquire::Held(c) = backend.try_acquire(&batch, holder(), TTL, 3, Line::Outside) else {
        panic!("granted twice");
    };
    assert_eq!((c.keys.len(), c.total), (3, 50));
}

#[test]
fn expired_entries_are_swept_as_the_map_grows() {
    let backend = MemoryStore::new();
    let short = Duration::from_millis(1);
    for i in 0..(SHARDS * FIRST_SWEEP_AT) {
        let key = vec![format!("lock:{i}")];
        assert!(grants(&backend, &key, holder(), short));
    }
    std::thread::sleep(Duration::from_millis(5));
    for i in 0..(SHARDS * FIRST_SWEEP_AT) {
        let key = vec![format!("again:{i}")];
        assert!(grants(&backend, &key, holder(), TTL));
    }
    // Without sweeping all 2 * 65,536 entries would remain.
    assert!(
        backend.len() < 2 * SHARDS * FIRST_SWEEP_AT * 3 / 4,
        "{}",
        backend.len()
    );
}

#[test]
fn extend_needs_every_key_still_held_by_the_owner() {
    let backend = MemoryStore::new();
    let (a, b) = (holder(), holder());
    let short = Duration::from_millis(30);
    assert!(grants(&backend, &keys(&["1", "2"]), a, short));
    assert!(
        !backend.try_extend(&keys(&["1", "2"]), b, TTL),
        "a foreign owner extended"
    );
    assert!(backend.try_extend(&keys(&["1", "2"]), a, TTL));
    std::thread::sleep(short * 2);
    // Extended past the original expiry: still held.
    assert!(!grants(&backend, &keys(&["2"]), b, TTL));

    assert_eq!(backend.release_owned(&keys(&["2"]), a), 1);
    assert!(
        !backend.try_extend(&keys(&["1", "2"]), a, TTL),
        "extended a partly lost lease"
    );
}

#[test]
fn fencing_tokens_increase_with_every_grant() {
    let backend = MemoryStore::new();
    let fence = |outcome| match outcome {
        Acquire::Granted(token) => token,
        Acquire::Held(_) => panic!("refused"),
    };
    let first = fence(backend.try_acquire(&keys(&["1"]), holder(), TTL, 0, Line::Outside));
    let second = fence(backend.try_acquire(&keys(&["2"]), holder(), TTL, 0, Line::Outside));
    assert_eq!(second.get(), first.get() + 1);

    // A store made later, as after a restart of the process, starts above every token the
    // first one handed out: its counter starts at the clock's floor.
    for i in 0..100 {
        let key = format!("more:{i}");
        fence(backend.try_acquire(&keys(&[&key]), holder(), TTL, 0, Line::Outside));
    }
    std::thread::sleep(Duration::from_millis(2));
    let restarted = MemoryStore::new();
    let after = fence(restarted.try_acquire(&keys(&["1"]), holder(), TTL, 0, Line::Outside));
    assert!(after.get() > second.get() + 100, "{after} after {second}");
}

#[test]
fn an_owner_reenters_its_keys_and_frees_them_with_its_last_hold() {
    let backend = MemoryStore::new();
    let outer = holder();
    let inner = Holder::new(outer.owner);
    let stranger = holder();
    assert!(grants(&backend, &keys(&["1"]), outer, TTL));
    // Re-entry, with a new key in the same batch: granted, not contended.
    assert!(grants(&backend, &keys(&["1", "2"]), inner, TTL));
    assert!(!grants(&backend, &keys(&["1"]), stranger, TTL));

    // The inner release keeps the outer hold, and is harmless twice.
    assert_eq!(backend.release_owned(&keys(&["1", "2"]), inner), 2);
    assert_eq!(backend.release_owned(&keys(&["1", "2"]), inner), 0);
    assert!(!grants(&backend, &keys(&["1"]), stranger, TTL));
    assert!(grants(&backend, &keys(&["2"]), stranger, TTL));

    // The outermost release frees the key.
    assert_eq!(backend.release_owned(&keys(&["1"]), outer), 1);
    assert!(grants(&backend, &keys(&["1"]), stranger, TTL));
}

#[test]
fn reentry_never_shortens_a_lease_and_extends_only_its_own_hold() {
    let backend = MemoryStore::new();
    let outer = holder();
    let inner = Holder::new(outer.owner);
    let short = Duration::from_millis(20);
    assert!(grants(&backend, &keys(&["1"]), outer, TTL));
    assert!(grants(&backend, &keys(&["1"]), inner, short));
    std::thread::sleep(short * 2);
    assert!(
        !grants(&backend, &keys(&["1"]), holder(), TTL),
        "re-entry shortened the lease"
    );
    assert!(backend.try_extend(&keys(&["1"]), inner, TTL));
    assert_eq!(backend.release_owned(&keys(&["1"]), inner), 1);
    assert!(
        !backend.try_extend(&keys(&["1"]), inner, TTL),
        "extended a released hold"
    );
    assert!(backend.try_extend(&keys(&["1"]), outer, TTL));
}
