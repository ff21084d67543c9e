//! Node URLs: `redis://` and `rediss://` parsed into what the driver
//! connects to, checked (no server twice), and shown without credentials.

use std::collections::HashSet;

use crate::driver::conn::Target;
use crate::driver::node::NodeSpec;
use crate::error::InvalidInput;

/// Parses and checks node URLs: at least one, each parsable, no server
/// twice, with the default TLS settings.
#[cfg(test)]
pub(crate) fn parse_nodes(urls: &[String]) -> Result<Vec<NodeSpec>, InvalidInput> {
    parse_nodes_with(urls, &TlsSettings::default())
}

/// The TLS settings of a builder (nothing without the `tls-rustls` feature).
#[derive(Clone, Default, Debug)]
pub(crate) struct TlsSettings {
    #[cfg(feature = "tls-rustls")]
    pub(crate) tls: Option<crate::driver::tls::Tls>,
}

/// `parse_nodes` (test builds) with `tls` for `rediss://` nodes (the default roots when
/// none is set).
pub(crate) fn parse_nodes_with(
    urls: &[String],
    tls: &TlsSettings,
) -> Result<Vec<NodeSpec>, InvalidInput> {
    if urls.is_empty() {
        return Err(InvalidInput::NoNodes);
    }
    #[cfg(feature = "tls-rustls")]
    let mut tls_config = None;
    let mut seen = HashSet::new();
    let mut specs = Vec::with_capacity(urls.len());
    for url in urls {
        let bad = |reason: &str| InvalidInput::BadNodeUrl {
            url: redact(url),
            reason: reason.to_owned(),
        };
        let parsed = url::Url::parse(url).map_err(|e| match e {
            url::ParseError::RelativeUrlWithoutBase => {
                bad("not a URL: a node is redis://host:port (rediss:// for TLS)")
            }
            e => bad(&e.to_string()),
        })?;
        let secure = is_tls(&parsed).map_err(bad)?;
        let host = host_of(&parsed).map_err(bad)?;
        let port = parsed.port().unwrap_or(6379);
        no_query_or_fragment(&parsed).map_err(bad)?;
        let db = database(&parsed).map_err(bad)?;
        let (username, password) = credentials(&parsed).map_err(bad)?;
        let host_port = host_port(&parsed, &host, port);
        if !seen.insert(host_port.clone()) {
            return Err(InvalidInput::DuplicateNode(host_port));
        }
        let name = if db == 0 {
            host_port
        } else {
            format!("{host_port}/{db}")
        };
        #[cfg(feature = "tls-rustls")]
        let tls_target = if secure {
            if tls_config.is_none() {
                tls_config = Some(tls.tls.clone().unwrap_or_default().config()?);
            }
            let config = tls_config.clone().ok_or(InvalidInput::NoNodes)?;
            Some(crate::driver::tls::TlsTarget::new(config, &host).map_err(|e| bad(&e))?)
        } else {
            None
        };
        #[cfg(not(feature = "tls-rustls"))]
        if secure {
            let _ = tls;
            return Err(bad(
                "rediss:// (TLS) nodes need the crate feature `tls-rustls`",
            ));
        }
        specs.push(NodeSpec {
            name,
            target: Target {
                host,
                port,
                username,
                password,
                db,
                #[cfg(feature = "tls-rustls")]
                tls: tls_target,
            },
        });
    }
    Ok(specs)
}

/// Whether a node URL's scheme asks for TLS (`rediss://`) or not
/// (`redis://`); no other is a node's.
fn is_tls(parsed: &url::Url) -> Result<bool, &'static str> {
    match parsed.scheme() {
        "redis" => Ok(false),
        "rediss" => Ok(true),
        _ => Err("only redis:// and rediss:// (TCP) nodes are supported"),
    }
}

/// A node URL's host: a name, or an IP address without brackets.
fn host_of(parsed: &url::Url) -> Result<String, &'static str> {
    match parsed.host() {
        Some(url::Host::Domain(d)) if !d.is_empty() => Ok(d.to_owned()),
        Some(url::Host::Ipv4(ip)) => Ok(ip.to_string()),
        Some(url::Host::Ipv6(ip)) => Ok(ip.to_string()),
        _ => Err("no host"),
    }
}

/// The server's `host:port`, as node names show it and the check for a
/// server listed twice compares it: a name in lower case, an IPv6 address
/// in brackets.
fn host_port(parsed: &url::Url, host: &str, port: u16) -> String {
    match parsed.host() {
        Some(url::Host::Ipv6(_)) => format!("[{host}]:{port}"),
        _ => format!("{}:{port}", host.to_ascii_lowercase()),
    }
}

/// A node URL has neither query nor fragment (where a fragment is most
/// likely the rest of a password with a `#` in it).
fn no_query_or_fragment(parsed: &url::Url) -> Result<(), &'static str> {
    if parsed.query().is_some() {
        return Err("query parameters are not supported (give the database as the path: /N)");
    }
    if let Some(f) = parsed.fragment() {
        return Err(if f == "insecure" {
            "certificate verification cannot be turned off (#insecure): \
             trust the node's CA with Tls::ca_file"
        } else {
            "a fragment (#…) is not supported; a password with `#`, `/`, `?` or `@` \
             must be percent-encoded (%23, %2F, %3F, %40)"
        });
    }
    Ok(())
}

/// A node URL's database: its path's number, 0 without one.
fn database(parsed: &url::Url) -> Result<i64, &'static str> {
    match parsed.path().trim_start_matches('/') {
        "" => Ok(0),
        p => p.parse::<i64>().ok().filter(|db| *db >= 0).ok_or(
            "the path must be a database number (/0, /1, …); a password with \
                         `#`, `/`, `?` or `@` must be percent-encoded (%23, %2F, %3F, %40)",
        ),
    }
}

/// A node URL's user name (none when empty) and password, percent-decoded.
fn credentials(parsed: &url::Url) -> Result<(Option<String>, Option<String>), &'static str> {
    let decode = |s: &str| -> Result<String, &'static str> {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|v| v.into_owned())
            .map_err(|_| "the credentials are not UTF-8 once decoded")
    };
    let username = match parsed.username() {
        "" => None,
        u => Some(decode(u)?),
    };
    let password = parsed.password().map(decode).transpose()?;
    Ok((username, password))
}

/// Whether a URL path is empty or a database number.
fn db_path(path: &str) -> bool {
    let p = path.trim_start_matches('/');
    p.is_empty() || p.bytes().all(|b| b.is_ascii_digit())
}

/// The URL with its password and query masked, for messages. A URL that
/// does not parse cleanly is shown as written, with whatever may hold a
/// password masked (see [`redact_text`]), so that one can tell which entry
/// is wrong.
pub(crate) fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        // A fragment, or a path that is no database number, may be the rest
        // of a password the parser took for a port (`:2024#Summer@…`).
        Ok(u)
            if !u.cannot_be_a_base()
                && u.host().is_some()
                && u.fragment().is_none()
                && db_path(u.path()) =>
        {
            let mut u = u;
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            if u.query().is_some() {
                u.set_query(Some("***"));
            }
            u.to_string()
        }
        _ => redact_text(url),
    }
}

/// A node URL as written, with `***` for each part that may hold a password:
/// the user-info up to its last `@` (but the user name before a `:`), a
/// port that is no number, a path that is no database number, a query or
/// a fragment. (A password with a `#`, `/` or `?` that is not
/// percent-encoded makes the parser see a port, a path or a fragment; one
/// with a `,` splits the entry in two.) The scheme, the host, a numeric
/// port and a database number are shown; an entry with no scheme only if
/// it is `host:port`.
fn redact_text(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest))
            if scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            (scheme, rest)
        }
        // No scheme: a `host:port` that forgot its `redis://`, shown; or a
        // piece of a password with commas (`redis://u:123,s3cret,x@h:1`
        // splits into three entries), masked whole up to its last `@`.
        _ => match url.rsplit_once(':') {
            _ if url.contains('@') => {
                let at = url.rfind('@').map_or(0, |a| a + 1);
                return format!("***@{}", redact_text(&url[at..]));
            }
            Some((host, port))
                if !host.is_empty()
                    && !port.is_empty()
                    && port.bytes().all(|b| b.is_ascii_digit())
                    && !host.contains(['@', '/', '?', '#', ':']) =>
            {
                return url.to_owned()
            }
            _ => return "***".to_owned(),
        },
    };
    let mut out = format!("{scheme}://");
    let server = match rest.rfind('@') {
        Some(at) => {
            match rest[..at].split_once(':') {
                Some((user, _)) if !user.contains(['/', '?', '#']) => {
                    out.push_str(user);
                    out.push_str(":***@");
                }
                _ => out.push_str("***@"),
            }
            &rest[at + 1..]
        }
        None => rest,
    };
    let end = server.find(['/', '?', '#']).unwrap_or(server.len());
    let (authority, tail) = server.split_at(end);
    // The port follows the last `:`, outside an IPv6 address's brackets.
    let host_end = authority.rfind(']').map_or(0, |b| b + 1);
    match authority[host_end..].rfind(':').map(|i| i + host_end) {
        Some(colon) => {
            let port = &authority[colon + 1..];
            out.push_str(&authority[..=colon]);
            if port.bytes().all(|b| b.is_ascii_digit()) {
                out.push_str(port);
            } else {
                out.push_str("***");
            }
        }
        None => out.push_str(authority),
    }
    if !tail.is_empty() {
        if tail.starts_with('/') && tail.len() > 1 && db_path(tail) {
            out.push_str(tail);
        } else if let Some(first) = tail.chars().next() {
            out.push(first);
            out.push_str("***");
        }
    }
    out
}

impl crate::driver::conn::Target {
    /// `127.0.0.1:port`, in the clear, no credentials (the tests' listeners).
    #[cfg(test)]
    pub(crate) fn local(port: u16) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port,
            username: None,
            password: None,
            db: 0,
            #[cfg(feature = "tls-rustls")]
            tls: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_names_without_credentials() {
        let specs = parse_nodes(&urls(&[
            "redis://127.0.0.1:7001",
            "redis://user:secret@Example.COM:7002/3",
        ]))
        .unwrap();
        assert_eq!(specs[0].name, "127.0.0.1:7001");
        assert_eq!(specs[1].name, "example.com:7002/3");
        assert_eq!(specs[1].target.password.as_deref(), Some("secret"));
        assert_eq!(specs[1].target.username.as_deref(), Some("user"));
        assert_eq!(specs[1].target.db, 3);
        assert!(!format!("{:?}", specs[1]).contains("secret"));
    }

    #[test]
    fn rejects_bad_node_lists() {
        assert_eq!(parse_nodes(&[]).unwrap_err(), InvalidInput::NoNodes);
        assert_eq!(
            parse_nodes(&urls(&["redis://h:1", "redis://H:1/2"])).unwrap_err(),
            InvalidInput::DuplicateNode("h:1".into())
        );
        match parse_nodes(&urls(&["redis://u:pw@h:1", "http://u:pw@x:1"])).unwrap_err() {
            InvalidInput::BadNodeUrl { url, .. } => assert_eq!(url, "http://u:***@x:1/"),
            e => panic!("{e:?}"),
        }
        assert!(matches!(
            parse_nodes(&urls(&["not a url"])).unwrap_err(),
            InvalidInput::BadNodeUrl { .. }
        ));
    }

    #[test]
    fn redacts_credentials() {
        assert_eq!(redact("redis://u:p@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:p@h:1"), "redis://:***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
        assert_eq!(redact("rediss://u@h:1"), "rediss://u@h:1");
        // Secrets outside the user-info part: query parameters, and an `@`
        // inside the password itself.
        for (url, secret) in [
            ("redis+unix:///tmp/redis.sock?pass=s3cret", "s3cret"),
            ("unix:///tmp/redis.sock?db=1&pass=s3cret", "s3cret"),
            ("redis://h:1/0?password=s3cret", "s3cret"),
            ("redis://u:p%40ss@h:1", "p%40ss"),
            ("redis://u:s3cr@t@h:1", "s3cr@t"),
            ("redis://u:s3cret@h:99999", "s3cret"),
            ("redis://u:s3cret@[::1:1", "s3cret"),
            ("redis:s3cret", "s3cret"),
            // A password with a comma, split into two entries.
            ("redis://u:s3c", "s3c"),
            ("ret@h:1", "ret"),
            // The middle of one with two commas (`redis://u:123,s3cret,x@h:1`
            // splits into a valid URL, `s3cret` and `x@h:1`).
            ("s3cret", "s3cret"),
            ("s3c:ret", "s3c"),
            ("s3c/ret", "s3c"),
            // A password of digits then `#` or `/` parses as a port and a
            // fragment or a path: the secret is there, not in user-info.
            ("redis://locker:2024#Summer!@redis-1:6379", "Summer"),
            ("redis://locker:1234/Xy9@redis-1:6379", "Xy9"),
            ("redis://locker:1234?Xy9@redis-1:6379", "Xy9"),
        ] {
            let shown = redact(url);
            assert!(!shown.contains(secret), "{url} shown as {shown}");
            let text = match parse_nodes(&urls(&[url])) {
                Err(e) => format!("{e} {e:?}"),
                Ok(specs) => format!("{specs:?}"),
            };
            {
                assert!(!text.contains(secret), "{url}: {text}");
            }
        }
        let b =
            crate::Builder::new().nodes(["redis+unix:///s?pass=s3cret", "redis://u:s3cret@h:1"]);
        assert!(!format!("{b:?}").contains("s3cret"), "{b:?}");
    }

    /// A URL that does not parse is shown as written, so that one can
    /// tell which entry is wrong: only what may be a password is masked
    /// (it was shown as `redis://…` or `…`).
    #[test]
    fn a_malformed_url_is_shown_but_its_password() {
        for (url, shown) in [
            ("127.0.0.1:7401", "127.0.0.1:7401"),
            ("redis://127.0.0.1:port", "redis://127.0.0.1:***"),
            ("redis://h:1/x", "redis://h:1/***"),
            ("redis://u:s3cret@h:99999", "redis://u:***@h:99999"),
            (
                "redis://locker:2024#Summer!@redis-1:6379",
                "redis://locker:***@redis-1:6379",
            ),
            (
                "redis://locker:1234/Xy9@redis-1:6379",
                "redis://locker:***@redis-1:6379",
            ),
            (
                "redis+unix:///tmp/redis.sock?pass=s3cret",
                "redis+unix:///***",
            ),
            ("redis:///0", "redis:///0"),
            ("s3cret", "***"),
            ("s3c:ret@h:1", "***@h:1"),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
        match parse_nodes(&urls(&["127.0.0.1:7401"])).unwrap_err() {
            InvalidInput::BadNodeUrl { url, reason } => {
                assert_eq!(url, "127.0.0.1:7401");
                assert!(reason.contains("redis://"), "{reason}");
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn parses_urls_with_a_real_parser() {
        let specs = parse_nodes(&urls(&[
            "redis://h1",
            "redis://us%3Aer:p%40ss%3Aword@h2:7002/15",
            "redis://[::1]:7003",
        ]))
        .unwrap();
        assert_eq!(specs[0].name, "h1:6379");
        assert_eq!(specs[1].target.username.as_deref(), Some("us:er"));
        assert_eq!(specs[1].target.password.as_deref(), Some("p@ss:word"));
        assert_eq!(specs[1].target.db, 15);
        assert_eq!(specs[2].target.host, "::1");
        assert_eq!(specs[2].name, "[::1]:7003");
        // A password alone (Redis before 6: `AUTH password`).
        let s = &parse_nodes(&urls(&["redis://:pw@h:1"])).unwrap()[0];
        assert_eq!(s.target.username, None);
        assert_eq!(s.target.password.as_deref(), Some("pw"));
        for (url, why) in [
            ("redis+unix:///tmp/r.sock", "redis://"),
            ("redis://h:1/x", "database"),
            ("redis://h:1/-1", "database"),
            ("redis://h:1?db=2", "query"),
            ("redis:///0", "host"),
            ("rediss://h:1/#insecure", "insecure"),
        ] {
            match parse_nodes(&urls(&[url])) {
                Err(InvalidInput::BadNodeUrl { reason, .. }) => {
                    assert!(reason.contains(why), "{url}: {reason}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[cfg(not(feature = "tls-rustls"))]
    #[test]
    fn tls_urls_name_the_feature_they_need() {
        match parse_nodes(&urls(&["rediss://h:1"])) {
            Err(InvalidInput::BadNodeUrl { reason, .. }) => {
                assert!(reason.contains("tls-rustls"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
}
