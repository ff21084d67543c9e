//! Docker backend: testcontainers 0.28 (blocking API), plus the `docker` CLI for probing,
//! pulling, pause/unpause and sweeping leftovers.
//!
//! testcontainers 0.28 (without its `properties-config` feature, as here) takes the engine
//! address from `DOCKER_HOST`, else `/var/run/docker.sock`, else the rootless socket
//! paths. It re-reads that whenever it builds a new client, so the probe below sets
//! `DOCKER_HOST` once, before the first container is created, and never changes it again.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::SyncRunner;
use testcontainers::{Container, GenericImage, ImageExt};

use super::proxy::{self, ApiVersion, Endpoint};
use super::{owner_alive, owner_tag, run_cmd, wait_for_ping};

/// The API version testcontainers 0.28 / bollard 0.21 puts in every request path.
const CLIENT_API: ApiVersion = (1, 53);
const LABEL: &str = "quorumlock.harness";
const OWNER_LABEL: &str = "quorumlock.owner";
const READY: &str = "Ready to accept connections";
/// The same command for the stock image (its entrypoint runs `redis-server ...` as user
/// redis) and for `.ci/redis-image.sh`'s image (no entrypoint; PATH has redis-server).
fn redis_cmd() -> Vec<&'static str> {
    let mut cmd = vec!["redis-server", "--bind", "0.0.0.0"];
    cmd.extend(super::THROWAWAY);
    cmd
}

pub(crate) struct DockerEnv {
    /// What the CLI gets as DOCKER_HOST: the real engine, never the proxy.
    cli_host: String,
    image: String,
    name: String,
    tag: String,
    /// Host of the URLs: 127.0.0.1 for a local engine.
    url_host: String,
    local: bool,
}

fn cli(env_host: &str, args: &[&str], limit: Duration) -> Result<String, String> {
    run_cmd(
        Command::new("docker")
            .args(args)
            .env("DOCKER_HOST", env_host)
            .env_remove("DOCKER_CONTEXT"),
        limit,
    )
}

fn default_host() -> Result<String, String> {
    let mut candidates = vec![PathBuf::from("/var/run/docker.sock")];
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        candidates.push(PathBuf::from(d).join(".docker/run/docker.sock"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(&h).join(".docker/run/docker.sock"));
        candidates.push(PathBuf::from(&h).join(".docker/desktop/docker.sock"));
    }
    candidates
        .iter()
        .find(|p| p.exists())
        .map(|p| format!("unix://{}", p.display()))
        .ok_or_else(|| {
            "DOCKER_HOST is unset and there is no Docker socket at /var/run/docker.sock \
             (is the Docker engine installed and running?)"
                .to_string()
        })
}

/// Splits `name:tag` (the tag is what follows the last ':' after the last '/').
fn split_image(image: &str) -> (String, String) {
    match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name.to_string(), tag.to_string()),
        _ => (image.to_string(), "latest".to_string()),
    }
}

pub(crate) fn probe(image: &str) -> Result<DockerEnv, String> {
    let original = std::env::var("DOCKER_HOST")
        .ok()
        .filter(|s| !s.trim().is_empty());
    let host = match &original {
        Some(h) => h.trim().to_string(),
        None => default_host()?,
    };
    let (endpoint, url_host, local) = if let Some(p) = host.strip_prefix("unix://") {
        if !std::path::Path::new(p).exists() {
            return Err(format!("no Docker socket at {p} (DOCKER_HOST={host})"));
        }
        (
            Endpoint::Unix(PathBuf::from(p)),
            "127.0.0.1".to_string(),
            true,
        )
    } else if let Some(a) = host
        .strip_prefix("tcp://")
        .or_else(|| host.strip_prefix("http://"))
    {
        let a = a.trim_end_matches('/');
        let h = a.rsplit_once(':').map(|(h, _)| h).unwrap_or(a);
        let h = h.trim_start_matches('[').trim_end_matches(']');
        let url_host = if h == "localhost" || h.is_empty() {
            "127.0.0.1"
        } else {
            h
        };
        (Endpoint::Tcp(a.to_string()), url_host.to_string(), false)
    } else {
        return Err(format!(
            "unsupported DOCKER_HOST {host:?} (unix:// or tcp:// only)"
        ));
    };

    let version = cli(
        &host,
        &["version", "--format", "{{.Server.APIVersion}}"],
        Duration::from_secs(20),
    )
    .map_err(|e| format!("the Docker engine at {host} does not answer: {e}"))?;
    let api = proxy::parse_version(&version)
        .ok_or_else(|| format!("cannot parse the engine's API version {version:?}"))?;

    ensure_image(&host, image)?;
    if local {
        sweep_orphans(&host);
    }
    sweep_proxy_dirs();

    if api < CLIENT_API {
        if std::env::var("DOCKER_TLS_VERIFY").is_ok_and(|v| v == "1") {
            return Err(format!(
                "the engine at {host} speaks API {}.{} < {}.{} (what testcontainers 0.28 \
                 sends) and uses TLS, which the harness's version-rewriting proxy cannot relay",
                api.0, api.1, CLIENT_API.0, CLIENT_API.1
            ));
        }
        let sock = proxy::start(endpoint, api)
            .map_err(|e| format!("cannot start the Docker API proxy: {e}"))?;
        // Edition 2021: set_var is safe; std serialises its own env access. This runs
        // once, before the first testcontainers call of the process.
        std::env::set_var("DOCKER_HOST", format!("unix://{}", sock.display()));
    }
    let (name, tag) = split_image(image);
    Ok(DockerEnv {
        cli_host: host,
        image: image.to_string(),
        name,
        tag,
        url_host,
        local,
    })
}

fn ensure_image(host: &str, image: &str) -> Result<(), String> {
    if cli(
        host,
        &["image", "inspect", "--format", "{{.Id}}", image],
        Duration::from_secs(20),
    )
    .is_ok()
    {
        return Ok(());
    }
    let secs: u64 = std::env::var("QUORUMLOCK_DOCKER_PULL_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(60);
    eprintln!(
        "quorumlock test harness: image {image} is not present; pulling it (at most {secs} s)"
    );
    cli(host, &["pull", "--quiet", image], Duration::from_secs(secs)).map_err(|e| {
        format!(
            "image {image} is not present locally and could not be pulled ({e}); \
             without a registry build one with .ci/redis-image.sh and set \
             QUORUMLOCK_REDIS_IMAGE=quorumlock/redis:7-debian"
        )
    })?;
    Ok(())
}

/// Removes containers left by test processes of this host that died without Drop.
fn sweep_orphans(host: &str) {
    let fmt = format!("{{{{.ID}}}} {{{{.Label \"{OWNER_LABEL}\"}}}}");
    let Ok(list) = cli(
        host,
        &[
            "ps",
            "-a",
            "--filter",
            &format!("label={LABEL}"),
            "--format",
            &fmt,
        ],
        Duration::from_secs(20),
    ) else {
        return;
    };
    let me = super::hostname();
    let dead: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, owner)| owner.split('/').next() == Some(me.as_str()) && !owner_alive(owner))
        .map(|(id, _)| id)
        .collect();
    if !dead.is_empty() {
        let mut args = vec!["rm", "-f"];
        args.extend(dead.iter().copied());
        let _ = cli(host, &args, Duration::from_secs(60));
    }
}

/// Removes the socket directories of earlier test processes' proxies.
fn sweep_proxy_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("quorumlock-docker-proxy-") else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

pub(crate) struct DockerNode {
    container: Option<Container<GenericImage>>,
    id: String,
    cli_host: String,
    url_host: String,
    paused: bool,
    running: bool,
}

impl DockerNode {
    /// Starts a container with host port `port` mapped to 6379; returns it and the URL host.
    pub(crate) fn start(env: &DockerEnv, port: u16) -> Result<(DockerNode, String), String> {
        let mut req = GenericImage::new(env.name.clone(), env.tag.clone())
            .with_exposed_port(6379.tcp())
            .with_wait_for(WaitFor::message_on_stdout(READY))
            .with_cmd(redis_cmd())
            .with_mapped_port(port, 6379.tcp())
            .with_label(LABEL, "1")
            .with_label(OWNER_LABEL, owner_tag())
            .with_container_name(format!(
                "quorumlock-test-{}-{port}-{}",
                std::process::id(),
                super::nanos() % 1_000_000
            ))
            .with_startup_timeout(Duration::from_secs(60));
        if env.local {
            // Publish on loopback only: the nodes have no password.
            req = req.with_host_config_modifier(|hc| {
                for bindings in hc.port_bindings.iter_mut().flat_map(|m| m.values_mut()) {
                    for b in bindings.iter_mut().flatten() {
                        b.host_ip = Some("127.0.0.1".to_string());
                    }
                }
            });
        }
        let container = req
            .start()
            .map_err(|e| format!("starting a container of {}: {e}", env.image))?;
        let node = DockerNode {
            id: container.id().to_string(),
            container: Some(container),
            cli_host: env.cli_host.clone(),
            url_host: env.url_host.clone(),
            paused: false,
            running: true,
        };
        // The log line says redis is up inside; make sure the host port answers too.
        wait_for_ping(&node.url_host, port, Duration::from_secs(20), || Ok(()))
            .map_err(|e| format!("container {} of {}: {e}", node.short_id(), env.image))?;
        Ok((node, env.url_host.clone()))
    }

    fn short_id(&self) -> &str {
        &self.id[..self.id.len().min(12)]
    }

    fn container(&self) -> Result<&Container<GenericImage>, String> {
        self.container
            .as_ref()
            .ok_or_else(|| "container already removed".to_string())
    }

    pub(crate) fn stop(&mut self) -> Result<(), String> {
        if self.paused {
            self.unpause()?;
        }
        if self.running {
            self.container()?
                .stop_with_timeout(Some(2))
                .map_err(|e| format!("docker stop {}: {e}", self.short_id()))?;
            self.running = false;
        }
        Ok(())
    }

    pub(crate) fn restart(&mut self, host: &str, port: u16) -> Result<(), String> {
        self.stop()?;
        self.container()?
            .start()
            .map_err(|e| format!("docker start {}: {e}", self.short_id()))?;
        self.running = true;
        wait_for_ping(host, port, Duration::from_secs(30), || Ok(()))
            .map(|_| ())
            .map_err(|e| format!("container {} after restart: {e}", self.short_id()))
    }

    pub(crate) fn pause(&mut self) -> Result<(), String> {
        cli(
            &self.cli_host,
            &["pause", &self.id],
            Duration::from_secs(30),
        )?;
        self.paused = true;
        Ok(())
    }

    pub(crate) fn unpause(&mut self) -> Result<(), String> {
        cli(
            &self.cli_host,
            &["unpause", &self.id],
            Duration::from_secs(30),
        )?;
        self.paused = false;
        Ok(())
    }

    /// Final teardown: unpause if needed, then remove (force) the container.
    pub(crate) fn remove(self) {
        drop(self);
    }
}

impl Drop for DockerNode {
    fn drop(&mut self) {
        if self.paused {
            let _ = self.unpause();
        }
        if let Some(c) = self.container.take() {
            if let Err(e) = c.rm() {
                eprintln!(
                    "quorumlock test harness: removing container {} via testcontainers failed ({e}); \
                     trying `docker rm -f`",
                    self.short_id()
                );
                if let Err(e) = cli(
                    &self.cli_host,
                    &["rm", "-f", &self.id],
                    Duration::from_secs(60),
                ) {
                    eprintln!("quorumlock test harness: {e}");
                }
            }
        }
    }
}
