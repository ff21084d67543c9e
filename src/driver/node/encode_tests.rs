//! Tests of [`super`]: the packed commands and the decoded replies.

use super::*;
use std::time::Instant;

#[test]
fn fallback_is_the_same_command_as_eval() {
    let keys = [Key::new("a", "t1"), Key::new("b", "t2")];
    let ops = [
        Op::Acquire {
            lean: None,
            intent: std::time::Duration::ZERO,
            place: crate::algorithm::round::Place::NONE,
            ttl: Duration::from_millis(1500),
            known_max: Duration::from_secs(3),
            fenced: true,
            after: {
                let mut a = After::NONE;
                a.insert(123_456_789);
                a.insert(42);
                a
            },
            known_prev: Duration::from_secs(1),
        },
        Op::Swap {
            ttl: Duration::from_millis(1500),
            known_max: Duration::from_secs(3),
            fence: Some(1 << 52),
        },
        Op::Fence { value: 1 << 52 },
        Op::Extend {
            ttl: Duration::from_millis(1500),
            linger: false,
            known_max: Duration::from_secs(3),
            after: After::NONE,
            known_prev: std::time::Duration::ZERO,
        },
        Op::Release {
            keep_until: Instant::now(),
            notice: 0,
        },
    ];
    for op in ops {
        let e = Encoded::new(op, &keys);
        let text = String::from_utf8_lossy(&e.packed).into_owned();
        let want = text.replacen("$7\r\nEVALSHA", "$4\r\nEVAL", 1).replacen(
            &format!("$40\r\n{}", sha_of(&text)),
            &format!("${}\r\n{}", e.code.len(), e.code),
            1,
        );
        assert_eq!(String::from_utf8_lossy(&e.fallback()), want, "{op:?}");
    }
}

fn sha_of(packed: &str) -> String {
    packed.split("\r\n").nth(4).unwrap_or_default().to_owned()
}

/// A fenced acquire answers a set key with its counter, not 1: a late
/// reply must still be seen as "set" (so that a lock released
/// meanwhile is deleted again behind it).
#[test]
fn a_late_fenced_set_is_seen_as_set() {
    // The history's five facts (positive ones), then the answer.
    let reply = |r: i64| Value::Array([1, 2, 3, 1, 9, r].map(Value::Int).to_vec());
    assert!(acquired_any(&reply(1)));
    assert!(acquired_any(&reply(1_796_000_000_000_000)));
    assert!(!acquired_any(&reply(0)), "exists");
    // A swap answers alone, without the history's facts.
    let swap = |r: i64| Value::Array(vec![Value::Int(r)]);
    assert!(acquired_any(&swap(1)), "swapped");
    assert!(!acquired_any(&swap(0)), "absent");
    assert!(!acquired_any(&swap(-1)), "another owner");
    // A lean acquire's three frames: its SET decides, not the PTTL.
    let lean = |set: Value| Value::Array(vec![set, Value::Int(5000), Value::Nil]);
    assert!(acquired_any(&lean(Value::Okay)));
    assert!(!acquired_any(&lean(Value::Nil)), "held by another owner");
    let refused = crate::testing::sim::redis::error("OOM command not allowed");
    assert!(!acquired_any(&lean(refused)), "refused");
}

/// The lean acquire is three plain commands naming only its key and the
/// history's; its reply says set or held (with the owner's time left,
/// none known where PTTL is refused or the key never expires) and the
/// epoch read after the SET (0: none); a refused SET or HGET is the
/// node's error.
#[test]
fn a_lean_acquire_sends_three_commands_and_reads_their_replies() {
    let op = Op::Acquire {
        lean: Some(7),
        intent: Duration::ZERO,
        place: crate::algorithm::round::Place::NONE,
        ttl: Duration::from_millis(1500),
        known_max: Duration::from_secs(3),
        fenced: false,
        after: After::NONE,
        known_prev: Duration::ZERO,
    };
    let e = Encoded::new(op, &[Key::new("lock:a", "t1")]);
    let text = String::from_utf8_lossy(&e.packed).into_owned();
    let want = [
        "*6\r\n$3\r\nSET\r\n$6\r\nlock:a\r\n$2\r\nt1\r\n$2\r\nNX\r\n$2\r\nPX\r\n$4\r\n1500\r\n",
        "*2\r\n$4\r\nPTTL\r\n$6\r\nlock:a\r\n",
        "*3\r\n$4\r\nHGET\r\n$15\r\nquorumlock:meta\r\n$5\r\nepoch\r\n",
    ]
    .concat();
    assert_eq!(text, want);
    assert_eq!(
        (e.frames, e.written.as_slice()),
        (3, ["t1".to_owned()].as_slice())
    );
    let epoch = |t: &str| Value::BulkString(t.as_bytes().to_vec());
    let read = |set: Value, pttl: Value, ep: Value| e.decode(Value::Array(vec![set, pttl, ep]));
    let r = read(Value::Okay, Value::Int(1500), epoch("1796000000000")).expect("set");
    assert_eq!(
        (r.answers.as_slice(), r.held),
        ([Answer::Ok].as_slice(), Vec::new())
    );
    assert_eq!(r.facts.map(|f| f.epoch), Some(1_796_000_000_000));
    let r = read(Value::Nil, Value::Int(900), Value::Nil).expect("held");
    assert_eq!(r.answers, [Answer::Other]);
    assert_eq!(r.held, [Some(Duration::from_millis(900))]);
    assert_eq!(r.facts.map(|f| f.epoch), Some(0), "no history");
    let never = read(Value::Nil, Value::Int(-1), epoch("5")).expect("held");
    assert_eq!(never.held, [Some(Duration::MAX)]);
    let refused =
        crate::testing::sim::redis::error("NOPERM no permissions to run the 'pttl' command");
    let r = read(Value::Nil, refused.clone(), epoch("5")).expect("held");
    assert_eq!(r.held, [Some(Duration::MAX)], "no end known");
    assert!(read(Value::Okay, Value::Int(1), refused.clone()).is_err());
    assert!(read(refused, Value::Int(1), epoch("5")).is_err());
    assert!(e.decode(Value::Array(vec![Value::Okay])).is_err());
}

/// An acquire that found the key held reports the owner's remaining
/// TTL (`-1 - PTTL`; 0: no expiry), key by key, fenced or not; a fenced
/// counter is still "set".
#[test]
fn an_acquire_reports_how_long_the_owner_holds() {
    let keys = [Key::new("a", "t1"), Key::new("b", "t2")];
    for fenced in [false, true] {
        let op = Op::Acquire {
            lean: None,
            intent: std::time::Duration::ZERO,
            place: crate::algorithm::round::Place::NONE,
            ttl: Duration::from_secs(1),
            known_max: Duration::ZERO,
            fenced,
            after: After::NONE,
            known_prev: std::time::Duration::ZERO,
        };
        let e = Encoded::new(op, &keys);
        let reply = |a: i64, b: i64| {
            let mut v = vec![Value::Int(1), Value::Int(2), Value::Int(3), Value::Int(1)];
            v.push(Value::BulkString(Vec::new()));
            v.extend([Value::Int(a), Value::Int(b)]);
            e.decode(Value::Array(v)).expect("decoded")
        };
        let r = reply(-1 - 250, -1 - 900);
        assert_eq!(r.answers, [Answer::Other, Answer::Other]);
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(r.held, [ms(250), ms(900)], "each key's own");
        let r = reply(-1, 1);
        assert_eq!(r.answers, [Answer::Other, Answer::Ok], "fenced {fenced}");
        assert_eq!(r.held, [ms(0), None]);
        assert_eq!(reply(0, -5).held, [Some(Duration::MAX), ms(4)], "no expiry");
        assert_eq!(
            reply(i64::MIN, 1).held[0].map(|d| d.as_millis()),
            Some(i64::MAX as u128)
        );
        assert!(reply(1, 1).held.is_empty());
    }
}

#[test]
fn millis_round_up_and_never_zero() {
    assert_eq!(millis_ceil(Duration::from_micros(1)), 1);
    assert_eq!(millis_ceil(Duration::from_micros(1500)), 2);
    assert_eq!(millis_ceil(Duration::from_millis(30_000)), 30_000);
    assert_eq!(millis_ceil(Duration::ZERO), 1);
    assert!(millis_ceil(Duration::MAX) > 0);
}

/// A script refused for good (an ACL, a renamed command, a server without
/// Lua, a command the script runs refused, in Redis 7.0's words and 7.2's)
/// is `ScriptsRefused`; an error that may pass (memory, a busy or read-only
/// server, the script's own error) stays a server error.
#[test]
fn a_script_refused_for_good_is_told_from_one_refused_for_now() {
    let e = Encoded::new(
        Op::Release {
            keep_until: Instant::now(),
            notice: 0,
        },
        &[Key::new("lock:a", "t1")],
    );
    let kind = |text: &str| match e.decode(crate::testing::sim::redis::error(text)) {
        Err((kind, detail)) => {
            assert_eq!(detail, text, "the server's words");
            kind
        }
        Ok(r) => panic!("{text}: decoded as {r:?}"),
    };
    for text in [
        "NOPERM this user has no permissions to run the 'evalsha' command",
        "ERR unknown command 'EVALSHA', with args beginning with: 'abc' ",
        "ERR Could not find scripting engine 'lua'",
        "ERR ACL failure in script: NOPERM this user has no permissions to run the 'zadd' command script: abc, on @user_script:12.",
        "ERR Error running script (call to f_abc): @user_script:12: The user executing the script can't run this command or subcommand",
        // Valkey names the user: a name is not what the server refused.
        "NOPERM User keyaccess has no permissions to run the 'evalsha' command",
        "ERR ACL failure in script: User api-key-access has no permissions to run the 'zadd' command script: on @user_script:146.",
    ] {
        assert_eq!(kind(text), NodeErrorKind::ScriptsRefused, "{text}");
    }
    for text in [
        "OOM command not allowed when used memory > 'maxmemory'.",
        "READONLY You can't write against a read only replica.",
        "BUSY Redis is busy running a script.",
        "NOPERM No permissions to access a key",
        "NOPERM this user has no permissions to access one of the keys used as arguments",
        "ERR ACL failure in script: No permissions to access a key script: abc, on @user_script:3.",
        "ERR The user executing the script can't access at least one of the keys mentioned in the command arguments script: abc, on @user_script:1.",
        "ERR ACL failure in script: No permissions to access a channel script: on @user_script:1.",
        "ERR The user executing the script can't publish to the channel mentioned in the command script: abc, on @user_script:1.",
        "ERR Error running script (call to f_abc): @user_script:3: WRONGTYPE Operation against a key holding the wrong kind of value",
    ] {
        assert_eq!(kind(text), NodeErrorKind::Server, "{text}");
    }
}
