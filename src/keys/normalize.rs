//! From the keys an extractor read to the keys a store locks.

use std::sync::Arc;

use http::StatusCode;

use super::extractor::Key;
use crate::{
    rejection::Rejection,
    store::contract::{Mode, Modes},
};

/// The namespace and the limits every batch is held to.
#[derive(Debug, Clone)]
pub(crate) struct KeyPolicy {
    pub(crate) prefix: Arc<str>,
    pub(crate) max_keys: usize,
    pub(crate) max_key_len: usize,
}

/// A normalized batch: the stored keys, sorted, and how each is held.
#[derive(Debug)]
pub(crate) struct Batch {
    pub(crate) keys: Arc<[String]>,
    pub(crate) modes: Modes,
}

/// Prefixes, sorts and deduplicates `keys`, and enforces the limits; with `all_shared`,
/// every key is held shared, whatever it says.
///
/// Every stored key starts with the prefix, so nothing a client sends can name a key
/// outside the namespace. Sorting makes the batch the same whatever order the request
/// listed its resources in, and so does the answer to a batch that breaks a limit: the
/// checks look at the sorted set (the longest key, the number of distinct keys), never at
/// whichever bad key came first. Keys are compared byte for byte, as the store does. A key
/// named in both modes is held exclusively: the mode sorts after the name, exclusive first,
/// and the first of equal names stays.
///
/// # Errors
///
/// 400 for an empty key, one with a NUL character (U+0000), or one longer than
/// `max_key_len` bytes; 413 for more than `max_keys` distinct keys. When several limits
/// are broken, that order decides which one the answer names.
pub(crate) fn normalize(
    keys: Vec<Key>,
    policy: &KeyPolicy,
    all_shared: bool,
) -> Result<Batch, Rejection> {
    let mut keys: Vec<(String, Mode)> = keys.into_iter().map(Key::into_parts).collect();
    keys.sort_unstable();
    keys.dedup_by(|later, first| later.0 == first.0);
    // Sorted, so an empty key would be the first. Refusing it also keeps clients off the
    // bare prefix, which a store may use for itself (the Redis store's fencing counter).
    if keys.first().is_some_and(|(key, _)| key.is_empty()) {
        return Err(Rejection::limit(
            StatusCode::BAD_REQUEST,
            "empty_key",
            "a lock key is empty; every resource the request touches needs a name".to_owned(),
        ));
    }
    // PostgreSQL's `text` cannot hold a NUL, and no resource id needs one: refused on every
    // store, so that a key means the same wherever the locks live (on PostgreSQL the store
    // would fail, a 503 and an outage logged for a client's typo).
    if keys.iter().any(|(key, _)| key.contains('\0')) {
        return Err(Rejection::limit(
            StatusCode::BAD_REQUEST,
            "nul_in_key",
            "a lock key holds a NUL character (U+0000), which no key may hold".to_owned(),
        ));
    }
    let longest = keys.iter().map(|(key, _)| key.len()).max().unwrap_or(0);
    if longest > policy.max_key_len {
        return Err(Rejection::limit(
            StatusCode::BAD_REQUEST,
            "max_key_len",
            format!(
                "a lock key is {longest} bytes long; the limit is {} bytes",
                policy.max_key_len
            ),
        ));
    }
    if keys.len() > policy.max_keys {
        return Err(Rejection::limit(
            StatusCode::PAYLOAD_TOO_LARGE,
            "max_keys",
            format!(
                "the request locks {} resources; the limit is {} at once",
                keys.len(),
                policy.max_keys
            ),
        ));
    }
    let modes = if all_shared {
        Modes::All(Mode::Shared)
    } else {
        Modes::of_each(keys.iter().map(|&(_, mode)| mode))
    };
    // One prefix in front of every key keeps them in the order just sorted. Collected
    // straight into the shared slice that the request, its guard and its lease hold.
    let keys = keys
        .into_iter()
        .map(|(key, _)| [&*policy.prefix, &*key].concat())
        .collect();
    Ok(Batch { keys, modes })
}

/// The stored keys of `keys`, each held exclusively: what the tests compare.
#[cfg(test)]
fn exclusive(keys: Vec<String>, policy: &KeyPolicy) -> Result<Vec<String>, Rejection> {
    let keys = keys.into_iter().map(Key::from).collect();
    normalize(keys, policy, false).map(|batch| batch.keys.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> KeyPolicy {
        KeyPolicy {
            prefix: "lock:".into(),
            max_keys: 3,
            max_key_len: 8,
        }
    }

    fn keys(keys: &[&str]) -> Vec<String> {
        keys.iter().map(|&k| k.to_owned()).collect()
    }

    #[test]
    fn prefixes_sorts_and_dedupes() {
        let stored = exclusive(keys(&["b", "a", "b", "c", "a"]), &policy()).unwrap();
        assert_eq!(stored, ["lock:a", "lock:b", "lock:c"]);
    }

    #[test]
    fn is_independent_of_order_and_repetition() {
        let a = exclusive(keys(&["x", "y", "z"]), &policy()).unwrap();
        let b = exclusive(keys(&["z", "x", "y", "x"]), &policy()).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn counts_distinct_keys_against_the_limit() {
        assert!(exclusive(keys(&["a", "a", "b", "c"]), &policy()).is_ok());
        let err = exclusive(keys(&["a", "b", "c", "d"]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            err.detail(),
            "the request locks 4 resources; the limit is 3 at once"
        );
    }

    #[test]
    fn names_the_longest_key_whatever_the_order() {
        for order in [["123456789", "1234567890"], ["1234567890", "123456789"]] {
            let err = exclusive(keys(&order), &policy()).unwrap_err();
            assert_eq!(
                err.detail(),
                "a lock key is 10 bytes long; the limit is 8 bytes"
            );
        }
    }

    #[test]
    fn a_key_named_in_both_modes_is_held_exclusively() {
        let keys = vec![
            Key::shared("b"),
            Key::shared("a"),
            Key::exclusive("b"),
            Key::shared("b"),
        ];
        let batch = normalize(keys.clone(), &policy(), false).unwrap();
        assert_eq!(*batch.keys, ["lock:a", "lock:b"]);
        let each = Modes::Each(vec![Mode::Shared, Mode::Exclusive].into());
        assert_eq!(batch.modes, each);
        // One mode for all needs no list; a shared route holds every key shared.
        let all = |keys: Vec<Key>, shared| normalize(keys, &policy(), shared).unwrap().modes;
        assert_eq!(all(vec![Key::shared("a")], false), Modes::All(Mode::Shared));
        assert_eq!(all(vec!["a".into()], false), Modes::All(Mode::Exclusive));
        assert_eq!(all(keys, true), Modes::All(Mode::Shared));
    }

    #[test]
    fn refuses_empty_nul_and_overlong_keys() {
        let err = exclusive(keys(&["a", ""]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        let err = exclusive(keys(&["a", "b\0c"]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert!(err.detail().contains("NUL"), "{}", err.detail());
        assert!(exclusive(keys(&["12345678"]), &policy()).is_ok());
        let err = exclusive(keys(&["123456789"]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            err.detail(),
            "a lock key is 9 bytes long; the limit is 8 bytes"
        );
    }
}

/// The property over [`normalize`], with random keys and policies; the other properties, which
/// drive the public API, are in `tests/it/fuzz.rs`, whose documentation says how to run them
/// for longer (`FUZZ_SECS`).
#[cfg(test)]
pub(super) mod fuzz {
    use std::time::{Duration, Instant};

    use proptest::{
        collection::vec,
        prelude::*,
        test_runner::{Config, TestCaseError, TestRunner},
    };

    use super::*;

    /// Runs `test` over `strategy`: `cases` cases, or batches of them until `FUZZ_SECS` have
    /// passed.
    pub(in crate::keys) fn check<S>(
        name: &str,
        cases: u32,
        strategy: S,
        test: impl Fn(S::Value) -> Result<(), TestCaseError>,
    ) where
        S: Strategy,
        S::Value: std::fmt::Debug,
    {
        let budget = std::env::var("FUZZ_SECS").ok().map(|secs| {
            Duration::from_secs(secs.parse().expect("FUZZ_SECS is a number of seconds"))
        });
        let started = Instant::now();
        let mut ran = 0u64;
        loop {
            let mut runner = TestRunner::new(Config {
                cases,
                failure_persistence: None,
                ..Config::default()
            });
            if let Err(failure) = runner.run(&strategy, &test) {
                panic!("{name}: {failure}");
            }
            ran += u64::from(cases);
            if budget.is_none_or(|budget| started.elapsed() >= budget) {
                break;
            }
        }
        eprintln!(
            "{name}: {ran} cases in {:.1?}, no failure",
            started.elapsed()
        );
    }

    /// Keys as clients send them: any Unicode at all, or a few characters that collide,
    /// repeat and stress the store (braces, spaces, newlines, globs, non-ASCII).
    pub(in crate::keys) fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[ab{}: \n\t*?\"\\\\é€\u{0}]{0,6}",
            "[a-z]{0,12}",
        ]
    }

    fn policy() -> impl Strategy<Value = KeyPolicy> {
        ("[a-z:{}]{0,5}", 0usize..40, 0usize..16).prop_map(|(prefix, max_keys, max_key_len)| {
            KeyPolicy {
                prefix: prefix.into(),
                max_keys,
                max_key_len,
            }
        })
    }

    #[test]
    fn normalization_is_total_idempotent_and_independent_of_order() {
        let strategy = (vec(key(), 0..40), policy()).prop_flat_map(|(keys, policy)| {
            let shuffled = Just(keys.clone()).prop_shuffle();
            (Just(keys), shuffled, Just(policy))
        });
        check(
            "normalize",
            512,
            strategy,
            |(keys, mut shuffled, policy)| {
                // The same resources in another order, some of them twice.
                shuffled.extend(keys.iter().step_by(3).cloned());
                let normalized = exclusive(keys.clone(), &policy);
                let reordered = exclusive(shuffled, &policy);
                match (&normalized, &reordered) {
                    (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                    (Err(a), Err(b)) => {
                        prop_assert_eq!(a.status(), b.status());
                        prop_assert_eq!(a.detail(), b.detail());
                    }
                    _ => prop_assert!(false, "{normalized:?} but reordered {reordered:?}"),
                }

                let mut distinct = keys.clone();
                distinct.sort();
                distinct.dedup();
                let empty = distinct.iter().any(|k| k.is_empty() || k.contains('\0'));
                let too_long = distinct.iter().any(|k| k.len() > policy.max_key_len);
                let too_many = distinct.len() > policy.max_keys;
                match normalized {
                    Ok(stored) => {
                        prop_assert!(!empty && !too_long && !too_many);
                        // Exactly the distinct keys, each under the prefix, strictly sorted.
                        let expected: Vec<String> = distinct
                            .iter()
                            .map(|k| format!("{}{k}", policy.prefix))
                            .collect();
                        let mut sorted = expected.clone();
                        sorted.sort();
                        prop_assert_eq!(&stored, &sorted);
                        prop_assert!(stored.windows(2).all(|w| w[0] < w[1]));
                        prop_assert!(stored.iter().all(|k| k.starts_with(&*policy.prefix)));
                        // Idempotent: normalizing the stored keys again (less the prefix the store
                        // adds) gives them back.
                        let unprefixed: Vec<String> = stored
                            .iter()
                            .map(|k| k[policy.prefix.len()..].to_owned())
                            .collect();
                        prop_assert_eq!(exclusive(unprefixed, &policy).ok(), Some(stored.clone()));
                        let bare = KeyPolicy {
                            prefix: "".into(),
                            ..policy.clone()
                        };
                        let again = exclusive(stored.clone(), &bare);
                        if stored.iter().all(|k| k.len() <= bare.max_key_len) {
                            prop_assert_eq!(again.ok(), Some(stored));
                        }
                    }
                    Err(rejection) => {
                        prop_assert!(empty || too_long || too_many);
                        let expected = if empty || too_long {
                            StatusCode::BAD_REQUEST
                        } else {
                            StatusCode::PAYLOAD_TOO_LARGE
                        };
                        prop_assert_eq!(rejection.status(), expected);
                        prop_assert!(!rejection.detail().is_empty());
                    }
                }
                Ok(())
            },
        );
    }
}
