//! Tests of the Redlock decisions (`algorithm::quorum`).
use super::*;
use crate::error::NodeErrorKind;

const MS: Duration = Duration::from_millis(1);

fn fail(n: &str) -> NodeResult {
    Err(NodeError::new(n, NodeErrorKind::Timeout, ""))
}

fn tally(answers: &[Option<Answer>]) -> Tally {
    let results: Vec<NodeResult> = answers
        .iter()
        .enumerate()
        .map(|(i, a)| match a {
            Some(a) => Ok(crate::algorithm::round::Reply::new(vec![*a])),
            None => fail(&format!("n{i}")),
        })
        .collect();
    Tally::of(&results, 0)
}

#[test]
fn a_round_is_settled_by_a_majority_either_way() {
    let ok = || Some(Ok(crate::algorithm::round::Reply::new(vec![Answer::Ok])));
    let other = || Some(Ok(crate::algorithm::round::Reply::new(vec![Answer::Other])));
    let failed = || Some(fail("x"));
    assert!(!settled(&[ok(), None, None]));
    assert!(settled(&[ok(), ok(), None]));
    assert!(!settled(&[ok(), other(), None]));
    assert!(settled(&[other(), failed(), None]));
    assert!(!settled(&[ok(), ok(), None, None, None]));
    assert!(settled(&[ok(), ok(), ok(), None, None]));
    assert!(settled(&[other(), other(), other(), None, None]));
}

/// One vote per server: of two entries' answers for one server, the
/// one that did more counts (a release's second delete finds the key
/// gone), whatever order they arrive in; replicas and evicting nodes
/// do not vote.
#[test]
fn each_server_votes_once_and_unfit_nodes_not_at_all() {
    use crate::algorithm::round::{Reply, ServerTag};
    let names: Vec<String> = ["a", "a2", "b"].iter().map(|s| s.to_string()).collect();
    let tagged = |answer: Answer, run: u64, kind: ServerKind| -> NodeResult {
        let mut r = Reply::new(vec![answer]);
        r.server = Some(ServerTag {
            run: Some(run),
            history: None,
            kind,
        });
        Ok(r)
    };
    let rules = VoteRules::default();
    for order in [[0, 1], [1, 0]] {
        let mut results: Vec<Option<NodeResult>> = vec![None; 3];
        let answers = [Answer::Ok, Answer::Absent];
        for &i in &order {
            insert_vote(
                &mut results,
                &names,
                i,
                tagged(answers[i], 1, ServerKind::Fit),
                rules,
            );
        }
        insert_vote(
            &mut results,
            &names,
            2,
            tagged(Answer::Ok, 2, ServerKind::Fit),
            rules,
        );
        let t = Tally::of(&results.iter().flatten().cloned().collect::<Vec<_>>(), 0);
        assert_eq!((t.ok, t.absent), (2, 0), "{order:?}: {results:?}");
        assert_eq!(t.failures[0].kind(), NodeErrorKind::SameServer);
        assert_eq!(t.failures[0].node(), "a2");
    }
    let mut results: Vec<Option<NodeResult>> = vec![None; 3];
    insert_vote(
        &mut results,
        &names,
        0,
        tagged(Answer::Ok, 1, ServerKind::Replica),
        rules,
    );
    insert_vote(
        &mut results,
        &names,
        1,
        tagged(Answer::Ok, 2, ServerKind::Evicting("volatile-lru")),
        rules,
    );
    assert!(matches!(&results[0], Some(Err(e)) if e.kind() == NodeErrorKind::Unsuitable));
    assert!(matches!(&results[1], Some(Err(e)) if e.kind() == NodeErrorKind::Unsuitable));
    // Without tags (fake or old transports), nothing changes.
    let mut results: Vec<Option<NodeResult>> = vec![None; 2];
    insert_vote(
        &mut results,
        &names,
        0,
        Ok(Reply::new(vec![Answer::Ok])),
        rules,
    );
    insert_vote(
        &mut results,
        &names,
        1,
        Ok(Reply::new(vec![Answer::Ok])),
        rules,
    );
    assert!(results.iter().all(|r| matches!(r, Some(Ok(_)))));
}

/// An evicting node (`maxmemory` with any policy but `noeviction`) does not
/// vote by default: under memory pressure it drops a held lock's key, and
/// with two such nodes of three a second client was granted the lock while
/// the first held it. Its answer becomes a failure naming the policy and
/// what to set.
#[test]
fn default_rules_refuse_an_evicting_node() {
    use crate::algorithm::round::{Reply, ServerTag};
    let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    let evicting = |run: u64, policy: &'static str| -> NodeResult {
        let mut r = Reply::new(vec![Answer::Ok]);
        r.server = Some(ServerTag {
            run: Some(run),
            history: None,
            kind: ServerKind::Evicting(policy),
        });
        Ok(r)
    };
    let mut results: Vec<Option<NodeResult>> = vec![None; 3];
    let rules = VoteRules::default();
    insert_vote(&mut results, &names, 0, evicting(1, "allkeys-lru"), rules);
    insert_vote(&mut results, &names, 1, evicting(2, "volatile-ttl"), rules);
    insert_vote(
        &mut results,
        &names,
        2,
        Ok(Reply::new(vec![Answer::Ok])),
        rules,
    );
    for (i, policy) in [(0, "allkeys-lru"), (1, "volatile-ttl")] {
        match &results[i] {
            Some(Err(e)) => {
                assert_eq!(e.kind(), NodeErrorKind::Unsuitable);
                let detail = e.to_string();
                assert!(
                    detail.contains(policy)
                        && detail.contains("noeviction")
                        && detail.contains("allow_evicting_nodes"),
                    "{detail}"
                );
            }
            other => panic!("an evicting node voted by default: {other:?}"),
        }
    }
    let all: Vec<NodeResult> = results.into_iter().flatten().collect();
    let t = Tally::of(&all, 0);
    assert!(matches!(
        decide_acquire(t, Duration::from_secs(10), MS, MS),
        Err(Error::NoQuorum { agreed: 1, .. })
    ));
    // The opt-in counts them.
    let allowed = VoteRules {
        allow_evicting: true,
        ..rules
    };
    let mut results: Vec<Option<NodeResult>> = vec![None; 3];
    insert_vote(&mut results, &names, 0, evicting(1, "allkeys-lru"), allowed);
    insert_vote(
        &mut results,
        &names,
        1,
        evicting(2, "volatile-ttl"),
        allowed,
    );
    assert!(
        results[..2].iter().all(|r| matches!(r, Some(Ok(_)))),
        "{results:?}"
    );
}

#[test]
fn quorum_is_a_strict_majority() {
    let table = [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4)];
    for (n, q) in table {
        assert_eq!(quorum(n), q, "n = {n}");
    }
}

#[test]
fn drift_is_ttl_times_factor_plus_two_ms() {
    assert_eq!(drift_allowance(Duration::from_secs(10), 0.01), 102 * MS);
    assert_eq!(drift_allowance(Duration::ZERO, 0.01), 2 * MS);
    assert_eq!(drift_allowance(Duration::from_secs(1), 0.0), 2 * MS);
    // Extreme values saturate instead of panicking.
    assert!(drift_allowance(Duration::MAX, 0.5) > Duration::from_secs(u64::MAX / 4));
    assert_eq!(drift_allowance(Duration::MAX, 2.0), Duration::MAX);
}

#[test]
fn validity_saturates_at_zero() {
    assert_eq!(validity(100 * MS, 10 * MS, 3 * MS), 87 * MS);
    assert_eq!(validity(3 * MS, 10 * MS, 3 * MS), Duration::ZERO);
    assert_eq!(
        validity(Duration::ZERO, Duration::MAX, Duration::MAX),
        Duration::ZERO
    );
}

#[test]
fn acquire_needs_a_majority_and_positive_validity() {
    use Answer::*;
    let ttl = 1000 * MS;
    let drift = 12 * MS;
    let ok = decide_acquire(tally(&[Some(Ok), Some(Ok), None]), ttl, 5 * MS, drift);
    assert_eq!(ok.unwrap(), 983 * MS);

    let late = decide_acquire(tally(&[Some(Ok), Some(Ok), Some(Ok)]), ttl, 990 * MS, drift);
    assert!(
        matches!(late, Err(Error::ValidityExhausted { .. })),
        "{late:?}"
    );

    let taken = decide_acquire(tally(&[Some(Ok), Some(Other), Some(Other)]), ttl, MS, drift);
    assert!(
        matches!(taken, Err(Error::Taken { held: 2, nodes: 3 })),
        "{taken:?}"
    );

    // One OK, one taken, one failed: the failed node could have made a
    // majority, so the failure is what is reported.
    let noq = decide_acquire(tally(&[Some(Ok), Some(Other), None]), ttl, MS, drift);
    match noq {
        Err(Error::NoQuorum {
            agreed: 1,
            quorum: 2,
            failures,
        }) => {
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].node(), "n2");
        }
        other => panic!("{other:?}"),
    }

    // Two of three down.
    let down = decide_acquire(tally(&[Some(Ok), None, None]), ttl, MS, drift);
    assert!(
        matches!(down, Err(Error::NoQuorum { agreed: 1, .. })),
        "{down:?}"
    );
}

#[test]
fn release_tells_expired_from_stolen() {
    use Answer::*;
    assert!(decide_release(tally(&[Some(Ok), Some(Ok), Some(Absent)])).is_ok());
    assert!(matches!(
        decide_release(tally(&[Some(Absent), Some(Absent), Some(Ok)])),
        Err(Error::Expired)
    ));
    assert!(matches!(
        decide_release(tally(&[Some(Other), Some(Other), Some(Absent)])),
        Err(Error::NotOwner { nodes: 2 })
    ));
    assert!(matches!(
        decide_release(tally(&[Some(Ok), None, None])),
        Err(Error::NoQuorum { .. })
    ));
}

#[test]
fn extend_must_finish_inside_the_old_validity() {
    use Answer::*;
    let t = || tally(&[Some(Ok), Some(Ok), Some(Ok)]);
    let ttl = 100 * MS;
    assert_eq!(
        decide_extend(t(), ttl, 4 * MS, 3 * MS, 50 * MS).unwrap(),
        93 * MS
    );
    assert!(matches!(
        decide_extend(t(), ttl, 60 * MS, 3 * MS, 50 * MS),
        Err(Error::Expired)
    ));
    assert!(matches!(
        decide_extend(
            tally(&[Some(Other), Some(Absent), Some(Absent)]),
            ttl,
            MS,
            MS,
            50 * MS
        ),
        Err(Error::NotOwner { nodes: 1 })
    ));
}

#[test]
fn retry_delay_stays_in_its_band() {
    let base = 100 * MS;
    let jitter = 100 * MS;
    let rng = crate::clock::Rng::new(7);
    let mut lo = Duration::MAX;
    let mut hi = Duration::ZERO;
    for _ in 0..10_000 {
        let d = retry_delay(base, jitter, rng.next_u64());
        lo = lo.min(d);
        hi = hi.max(d);
    }
    assert!(
        hi <= 200 * MS && lo < 10 * MS && hi > 190 * MS,
        "{lo:?}..{hi:?}"
    );
    assert_eq!(retry_delay(base, Duration::ZERO, 12345), base);
    // No overflow for absurd settings.
    let _ = retry_delay(Duration::MAX, Duration::MAX, u64::MAX);
}
/// The fallback's bound: a majority is free once the quorum-th
/// soonest owner's key expires; a node our SET landed on is free now;
/// failures and keys without expiry are "never"; a set's node is free
/// once its longest-held key is.
#[test]
fn free_in_is_the_quorum_th_soonest_expiry() {
    use crate::algorithm::round::Reply;
    let keys = |held: Vec<Option<u64>>| -> NodeResult {
        let mut r = Reply::new(vec![Answer::Other]);
        r.held = held
            .into_iter()
            .map(|ms| {
                ms.map(|ms| {
                    if ms == u64::MAX {
                        Duration::MAX
                    } else {
                        Duration::from_millis(ms)
                    }
                })
            })
            .collect();
        Ok(r)
    };
    let held = |ms: Option<u64>| keys(vec![Some(ms.unwrap_or(u64::MAX))]);
    let ours = || -> NodeResult { Ok(Reply::new(vec![Answer::Ok])) };
    let ms = |n| Some(Duration::from_millis(n));
    assert_eq!(
        free_in(&[held(Some(300)), held(Some(100)), held(Some(200))]),
        ms(200)
    );
    assert_eq!(
        free_in(&[ours(), held(Some(900)), held(Some(400))]),
        ms(400)
    );
    assert_eq!(free_in(&[fail("a"), held(Some(900)), held(None)]), None);
    assert_eq!(
        free_in(&[fail("a"), held(Some(900)), held(Some(5))]),
        ms(900)
    );
    assert_eq!(
        free_in(&[
            held(Some(1)),
            held(Some(2)),
            fail("c"),
            fail("d"),
            held(Some(3))
        ]),
        ms(3)
    );
    assert_eq!(free_in(&[]), None);
    // A set: each node by its longest-held key (a free key, zero; ours, none).
    let set = [
        keys(vec![Some(0), Some(700)]),
        keys(vec![Some(300), None]),
        keys(vec![Some(50), Some(60)]),
    ];
    assert_eq!(free_in(&set), ms(300));
}

/// A round of many keys is not settled before any node answered: with no
/// reply yet, no key has its majority, and every node may still give one.
/// (It counted the keys among the replies, so zero replies meant zero keys,
/// all settled: renewal rounds of several locks ended before their replies
/// and, on nodes a few milliseconds away, failed every time.)
#[test]
fn a_round_of_many_keys_waits_for_its_replies() {
    use crate::algorithm::round::Reply;
    let ok2 = || Some(Ok(Reply::new(vec![Answer::Ok, Answer::Ok])));
    let half = || Some(Ok(Reply::new(vec![Answer::Ok, Answer::Other])));
    assert!(!settled_all(&[None, None, None], 2), "nothing answered");
    assert!(
        !settled_all(&[Some(fail("a")), None, None], 2),
        "one failure"
    );
    assert!(!settled_all(&[ok2(), None, None], 2), "one of a majority");
    assert!(
        settled_all(&[ok2(), ok2(), None], 2),
        "both keys at a majority"
    );
    assert!(
        !settled_all(&[ok2(), half(), None], 2),
        "the second key is short"
    );
    assert!(settled_all(&[half(), half(), half()], 2), "all in: decided");
    assert!(
        settled_all(&[Some(fail("a")), Some(fail("b")), None], 2),
        "no majority left"
    );
}

/// A woken attempt that meets the owners the attempt before it met (their time left
/// gone down by the time between, give or take a round) on every node and key that
/// answered both found no release: the message may be forged, foreign or late. A new
/// owner, or one that renewed, holds longer than the old one could still, or shorter
/// (a shorter TTL); an end known
/// where none was (or none where one was), a key freed or taken in between, is a change
/// too; with nothing to compare, every message counts.
#[test]
fn a_woken_attempt_tells_a_new_owner_from_the_same_one() {
    use Seen::{Free, Held, Unknown};
    let t0 = Instant::now();
    let later = t0 + 100 * MS;
    let slack = 2 * MS;
    let was = [Held(1000 * MS), Held(1003 * MS), Unknown];
    let new = |now: &[Seen]| new_owner(Some((t0, &was[..])), now, later, slack);
    // The same owner, its copies read on another majority (give or take the slack).
    assert!(!new(&[Held(900 * MS), Unknown, Held(905 * MS)]));
    assert!(!new(&[Held(902 * MS), Held(904 * MS), Held(950 * MS)]));
    // A new owner (or a renewal) on one node: more than the old one could have left.
    assert!(new(&[Held(900 * MS), Held(906 * MS), Unknown]));
    assert!(new(&[Held(10_000 * MS), Unknown, Unknown]));
    // A new owner with less time left than the old one's (a shorter TTL, a set's
    // longest-held key released): less than the old one can have left.
    assert!(new(&[Held(10 * MS), Unknown, Unknown]));
    assert!(new(&[Held(897 * MS), Unknown, Unknown]));
    assert!(!new(&[Held(898 * MS), Unknown, Unknown]));
    // A node freed or taken in between.
    assert!(new(&[Free, Held(903 * MS), Unknown]));
    // An end known where none was (a writer after readers refused by its intent), or
    // none where one was.
    assert!(new(&[Held(Duration::MAX), Unknown, Unknown]));
    let never = [Held(Duration::MAX); 3];
    assert!(new_owner(
        Some((t0, &never[..])),
        &[Held(5 * MS), Unknown, Unknown],
        later,
        slack
    ));
    // No node answered both: nothing to compare.
    assert!(new(&[Unknown, Unknown, Held(900 * MS)]));
    // An owner that never expires, before and now: the same.
    assert!(!new_owner(Some((t0, &never[..])), &never, later, slack));
    // No attempt before: every message counts.
    assert!(new_owner(None, &never, later, slack));
}

/// A lock of several: each key of each node is compared (node by node, key by key),
/// from the folded reply's times per key: another key of the set freed (a blocked
/// set's free key answers zero time left) is a change, though the first is held as
/// before.
#[test]
fn a_sets_other_key_freed_is_a_new_owner() {
    use crate::algorithm::round::Reply;
    let t0 = Instant::now();
    let reply = |second: Duration| {
        // (Folded: one answer for the set.)
        let mut r = Reply::new(vec![Answer::Other]);
        r.held = vec![Some(1000 * MS), Some(second)];
        Ok(r)
    };
    let before: Vec<NodeResult> = (0..3).map(|_| reply(500 * MS)).collect();
    let after: Vec<NodeResult> = (0..3).map(|_| reply(Duration::ZERO)).collect();
    let (was, now) = (seen(&before, 2), seen(&after, 2));
    assert_eq!(was.len(), 6);
    assert_eq!(now[1], Seen::Held(Duration::ZERO));
    assert!(new_owner(Some((t0, &was[..])), &now, t0 + MS, 2 * MS));
    assert!(!new_owner(Some((t0, &was[..])), &was, t0 + MS, 2 * MS));
}

/// A set's keys held elsewhere with time left, on any node.
#[test]
fn a_sets_blocking_keys_are_those_held_with_time_left() {
    use Seen::{Free, Held, Unknown};
    let z = Duration::ZERO;
    // Node by node, two keys each: `a` held, `b` free (zero time left) or ours.
    let seen = [
        Held(900 * MS),
        Held(z),
        Held(905 * MS),
        Free,
        Unknown,
        Unknown,
    ];
    assert_eq!(blocking(&seen, 2), [true, false]);
    // Held on one node is enough.
    let seen = [Held(z), Held(z), Held(z), Held(3 * MS), Unknown, Unknown];
    assert_eq!(blocking(&seen, 2), [false, true]);
    assert_eq!(blocking(&[Free, Held(z), Free, Free], 2), [false, false]);
    assert_eq!(blocking(&[Unknown; 6], 3), [false, false, false]);
    assert_eq!(blocking(&[Held(Duration::MAX), Free], 2), [true, false]);
}

/// Every way `results` can go on with replies from `more` of its pending
/// nodes (each OK, another owner's, or failed), for every choice of them.
fn go_on(results: &[Option<NodeResult>], more: usize, keys: usize) -> Vec<Vec<Option<NodeResult>>> {
    use crate::algorithm::round::Reply;
    let pending: Vec<usize> = (0..results.len())
        .filter(|&i| results[i].is_none())
        .collect();
    let kinds = |k: usize| -> Vec<NodeResult> {
        let mut v = vec![fail("x")];
        for mask in 0..(1u32 << k) {
            let a = (0..k)
                .map(|j| {
                    if mask & (1 << j) != 0 {
                        Answer::Ok
                    } else {
                        Answer::Other
                    }
                })
                .collect();
            v.push(Ok(Reply::new(a)));
        }
        v
    };
    let mut out = Vec::new();
    for pick in 0..(1u32 << pending.len()) {
        if pick.count_ones() as usize != more {
            continue;
        }
        let chosen: Vec<usize> = (0..pending.len())
            .filter(|j| pick & (1 << j) != 0)
            .map(|j| pending[j])
            .collect();
        let options = kinds(keys);
        let mut idx = vec![0usize; chosen.len()];
        loop {
            let mut r = results.to_vec();
            for (c, &i) in chosen.iter().enumerate() {
                r[i] = Some(options[idx[c]].clone());
            }
            out.push(r);
            let mut c = 0;
            while c < idx.len() {
                idx[c] += 1;
                if idx[c] < options.len() {
                    break;
                }
                idx[c] = 0;
                c += 1;
            }
            if c == idx.len() {
                break;
            }
        }
    }
    out
}

/// How many more replies a round needs before it can be settled is
/// exact, for rounds of 1 to 5 nodes and 1 or 2 keys from every state: no
/// `k - 1` more replies settle it, some `k` do. A round is not woken for
/// fewer, so a bound too high would keep it waiting past its outcome.
#[test]
fn the_replies_a_round_needs_are_exactly_those_that_can_settle_it() {
    for n in 1..=5usize {
        for keys in 1..=2usize {
            // Every state: per node, not in yet, or one of the kinds.
            for state in go_on(&vec![None; n], 0, keys)
                .into_iter()
                .chain((1..=n).flat_map(|m| go_on(&vec![None; n], m, keys)))
            {
                let need = if keys == 1 {
                    to_settle(&state)
                } else {
                    to_settle_all(&state, keys)
                };
                let settled_by = |r: &[Option<NodeResult>]| {
                    if keys == 1 {
                        to_settle(r) == 0
                    } else {
                        to_settle_all(r, keys) == 0
                    }
                };
                if need == 0 {
                    assert!(settled_by(&state));
                    continue;
                }
                if need > 1 {
                    assert!(
                        go_on(&state, need - 1, keys).iter().all(|r| !settled_by(r)),
                        "{n} nodes, {keys} keys, {state:?}: settled with fewer than {need}"
                    );
                }
                assert!(
                    go_on(&state, need, keys).iter().any(|r| settled_by(r)),
                    "{n} nodes, {keys} keys, {state:?}: not settled by {need}"
                );
            }
        }
    }
}

/// An OK that counts but not certainly (a young vote: a reply still to
/// come may disqualify it, and others with it) makes the round look at
/// every reply.
#[test]
fn a_round_with_votes_a_reply_may_disqualify_looks_at_every_reply() {
    use crate::algorithm::round::Reply;
    let ok = || Some(Ok(Reply::new(vec![Answer::Ok])));
    let r = [ok(), ok(), None, None, None];
    assert_eq!(to_settle_key(&r, 0, |_, _| true, |_, _| true), 1);
    let r = [ok(), None, None, None, None];
    assert_eq!(to_settle_key(&r, 0, |_, _| true, |_, _| true), 2);
    assert_eq!(to_settle_key(&r, 0, |_, _| false, |_, _| true), 1);
}
