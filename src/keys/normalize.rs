//! From the keys an extractor read to the keys a backend locks.

use http::StatusCode;

use crate::Rejection;

/// The namespace and the limits every batch is held to.
#[derive(Debug, Clone)]
pub(crate) struct KeyPolicy {
    pub(crate) prefix: String,
    pub(crate) max_keys: usize,
    pub(crate) max_key_len: usize,
}

/// Prefixes, sorts and deduplicates `keys`, and enforces the limits.
///
/// Every stored key starts with the prefix, so nothing a client sends can name a key
/// outside the namespace. Sorting makes the batch the same whatever order the request
/// listed its resources in, and so does the answer to a batch that breaks a limit: the
/// checks look at the sorted set (the longest key, the number of distinct keys), never at
/// whichever bad key came first. Keys are compared byte for byte, as the store does.
///
/// # Errors
///
/// 400 for an empty key or one longer than `max_key_len` bytes; 413 for more than
/// `max_keys` distinct keys. When several limits are broken, that order decides which one
/// the answer names.
pub(crate) fn normalize(
    mut keys: Vec<String>,
    policy: &KeyPolicy,
) -> Result<Vec<String>, Rejection> {
    keys.sort_unstable();
    keys.dedup();
    // Sorted, so an empty key would be the first. Refusing it also keeps clients off the
    // bare prefix, which a store may use for itself (the Redis store's fencing counter).
    if keys.first().is_some_and(String::is_empty) {
        return Err(Rejection::limit(
            StatusCode::BAD_REQUEST,
            "empty_key",
            "a lock key is empty; every resource the request touches needs a name".to_owned(),
        ));
    }
    let longest = keys.iter().map(String::len).max().unwrap_or(0);
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
    // One prefix in front of every key keeps them in the order just sorted.
    Ok(keys
        .into_iter()
        .map(|key| format!("{}{key}", policy.prefix))
        .collect())
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
        let stored = normalize(keys(&["b", "a", "b", "c", "a"]), &policy()).unwrap();
        assert_eq!(stored, ["lock:a", "lock:b", "lock:c"]);
    }

    #[test]
    fn is_independent_of_order_and_repetition() {
        let a = normalize(keys(&["x", "y", "z"]), &policy()).unwrap();
        let b = normalize(keys(&["z", "x", "y", "x"]), &policy()).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn counts_distinct_keys_against_the_limit() {
        assert!(normalize(keys(&["a", "a", "b", "c"]), &policy()).is_ok());
        let err = normalize(keys(&["a", "b", "c", "d"]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            err.body_text(),
            "the request locks 4 resources; the limit is 3 at once"
        );
    }

    #[test]
    fn names_the_longest_key_whatever_the_order() {
        for order in [["123456789", "1234567890"], ["1234567890", "123456789"]] {
            let err = normalize(keys(&order), &policy()).unwrap_err();
            assert_eq!(
                err.body_text(),
                "a lock key is 10 bytes long; the limit is 8 bytes"
            );
        }
    }

    #[test]
    fn refuses_empty_and_overlong_keys() {
        let err = normalize(keys(&["a", ""]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert!(normalize(keys(&["12345678"]), &policy()).is_ok());
        let err = normalize(keys(&["123456789"]), &policy()).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            err.body_text(),
            "a lock key is 9 bytes long; the limit is 8 bytes"
        );
    }
}
