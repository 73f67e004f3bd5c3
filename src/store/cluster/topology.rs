//! Which master serves which keys: the cluster's slot map, as `CLUSTER SLOTS` gives it,
//! and a pool for each master.
//!
//! redis-rs's cluster client keeps a slot map of its own, but routes a command by the slot
//! of one key; it exposes neither the map nor a key's slot number. A group of a batch is
//! one script call with keys of many slots on one master, so the store keeps this map, and
//! looks keys up by redis-rs's own slot computation ([`Slot::for_key`]).

use std::{collections::HashMap, sync::Arc};

use redis::{cluster_routing::Slot, Value};

use crate::store::{
    error::StoreError,
    redis::{scripts::CLAIMS, RedisStore},
};

/// The number of hash slots of a Redis Cluster.
const SLOTS: u16 = 16384;

/// One master, as the map knows it.
#[derive(Debug)]
pub(super) struct Master {
    /// `host:port`, for pools and logs (never a URL: it may carry a password).
    pub(super) address: Arc<str>,
    pub(super) node: Arc<RedisStore>,
}

/// The slot map at one moment.
#[derive(Debug, Default)]
pub(super) struct Topology {
    /// The master of each served slot, as an index into `masters`.
    owners: HashMap<Slot, usize>,
    pub(super) masters: Vec<Master>,
    /// Counts the maps this store has read: a caller that saw a stale one asks for the
    /// next, and concurrent callers share one refresh.
    pub(super) generation: u64,
}

/// The keys of a batch that one master serves, by their index in the batch.
#[derive(Debug)]
pub(super) struct Group {
    pub(super) master: usize,
    pub(super) indices: Vec<usize>,
}

impl Group {
    /// The group's keys out of the batch `keys`.
    pub(super) fn keys_of(&self, keys: &[String]) -> Arc<[String]> {
        self.indices.iter().map(|&i| keys[i].clone()).collect()
    }
}

impl Topology {
    /// The map that `CLUSTER SLOTS` answered, with a pool for each master from `pool_for`.
    ///
    /// A master given without a host (NULL or `""`: behind a load balancer, with
    /// `cluster-preferred-endpoint-type unknown-endpoint`, or not knowing its own address)
    /// is reached at `asked_host`, the host of the store's first URL, with the port it
    /// gives.
    /// One given as `"?"` (announced hostnames without one set) cannot be reached: its
    /// slots are left without a master, so that their keys get 503 and the others are
    /// served.
    pub(super) fn from_slots(
        reply: &Value,
        generation: u64,
        asked_host: &str,
        mut pool_for: impl FnMut(&str, u16) -> Result<Arc<RedisStore>, StoreError>,
    ) -> Result<Self, StoreError> {
        let invalid = || StoreError::left_nothing("the cluster answered CLUSTER SLOTS oddly");
        let Value::Array(ranges) = reply else {
            return Err(invalid());
        };
        let mut topology = Self {
            generation,
            ..Self::default()
        };
        let mut by_address = HashMap::new();
        for range in ranges {
            let Value::Array(fields) = range else {
                return Err(invalid());
            };
            let (Some(first), Some(last), Some(Value::Array(master))) =
                (int(fields.first()), int(fields.get(1)), fields.get(2))
            else {
                return Err(invalid());
            };
            let host = match master.first() {
                Some(Value::Nil) => asked_host.to_owned(),
                endpoint => match text(endpoint) {
                    Some(host) if host.is_empty() => asked_host.to_owned(),
                    Some(host) if host == "?" => continue,
                    Some(host) => host,
                    None => return Err(invalid()),
                },
            };
            let Some(port) = int(master.get(1)) else {
                return Err(invalid());
            };
            let port = u16::try_from(port).map_err(|_| invalid())?;
            let address = format!("{host}:{port}");
            let index = match by_address.get(&address) {
                Some(&index) => index,
                None => {
                    let node = pool_for(&host, port)?;
                    topology.masters.push(Master {
                        address: address.as_str().into(),
                        node,
                    });
                    by_address.insert(address, topology.masters.len() - 1);
                    topology.masters.len() - 1
                }
            };
            for slot in first..=last.min(i64::from(SLOTS) - 1) {
                let slot = u16::try_from(slot).ok().and_then(Slot::new);
                topology.owners.insert(slot.ok_or_else(invalid)?, index);
            }
        }
        for (index, master) in topology.masters.iter().enumerate() {
            let registry = topology.claims_registry(index).ok_or_else(invalid)?;
            master.node.name_claims_registry(registry);
        }
        Ok(topology)
    }

    /// The claims registry of the master at `index` (`claims.lua`): [`CLAIMS`] with the
    /// first hash tag, counting from 0, of a slot that the master serves. Every process
    /// with this map names the same one, and a waiter's claims on that master are all
    /// there; once the slot moves, the next map names another (the claims in the old one
    /// move with its slot: see "Resharding" in the store's docs). None for a master that
    /// serves no slot.
    fn claims_registry(&self, index: usize) -> Option<Arc<str>> {
        // A master that serves one slot of 16,384 finds it in about as many tries.
        (0..1_u32 << 20)
            .map(|tag| format!("{CLAIMS}{{{tag}}}"))
            .find(|name| self.owners.get(&Slot::for_key(name)) == Some(&index))
            .map(Into::into)
    }

    /// Whether every hash slot has a master.
    pub(super) fn serves_every_slot(&self) -> bool {
        self.owners.len() == usize::from(SLOTS)
    }

    /// The keys at `indices` of `keys`, grouped by their master, in the order given. Fails
    /// when a key's slot has no master (the cluster is missing slots, or the map is empty).
    pub(super) fn group(
        &self,
        keys: &[String],
        indices: impl IntoIterator<Item = usize>,
    ) -> Result<Vec<Group>, StoreError> {
        let mut groups: Vec<Group> = Vec::new();
        let mut group_of = vec![usize::MAX; self.masters.len()];
        for index in indices {
            let master = *self
                .owners
                .get(&Slot::for_key(&keys[index]))
                .ok_or_else(|| {
                    StoreError::left_nothing(
                        "a key's slot has no master in the cluster (or its master's \
                         address is unknown: `?` in CLUSTER SLOTS)",
                    )
                })?;
            if group_of[master] == usize::MAX {
                group_of[master] = groups.len();
                groups.push(Group {
                    master,
                    indices: Vec::new(),
                });
            }
            groups[group_of[master]].indices.push(index);
        }
        Ok(groups)
    }
}

fn int(value: Option<&Value>) -> Option<i64> {
    match value? {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

fn text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    }
}
