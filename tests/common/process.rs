//! Process backend: `redis-server` (or `valkey-server`) children on 127.0.0.1.
//!
//! Each node writes its log to `$TMPDIR/quorumlock-harness/<pid>-<port>.log` and its pid
//! (with the owner's `owner_tag`) to `...-<port>.pid`; a later test process kills the
//! redis-servers of an owner that died without running Drop (SIGKILL of the test binary).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{owner_alive, owner_tag, run_cmd, wait_for_ping};

const START_LIMIT: Duration = Duration::from_secs(15);

pub(crate) struct ProcessEnv {
    bin: PathBuf,
    dir: PathBuf,
    /// "Valkey 9.1.2", from `--version`.
    server: String,
}

pub(crate) fn probe() -> Result<ProcessEnv, String> {
    let mut errors = Vec::new();
    for bin in candidates() {
        match run_cmd(Command::new(&bin).arg("--version"), Duration::from_secs(10)) {
            Ok(v) if server_version(&v).is_some() => {
                let server = server_version(&v)
                    .map(|(name, version)| format!("{name} {version}"))
                    .unwrap_or_default();
                let dir = std::env::temp_dir().join("quorumlock-harness");
                fs::create_dir_all(&dir)
                    .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                sweep_orphans(&dir, &bin);
                return Ok(ProcessEnv { bin, dir, server });
            }
            Ok(v) => errors.push(format!(
                "{}: unexpected --version output {v:?} (neither Redis nor Valkey)",
                bin.display()
            )),
            Err(e) => errors.push(e),
        }
    }
    Err(format!(
        "no working redis-server or valkey-server: {}",
        errors.join("; ")
    ))
}

/// The server binaries to try, in order: `QUORUMLOCK_REDIS_SERVER` alone when set;
/// otherwise `redis-server` or `valkey-server` in PATH's order (within one directory
/// `redis-server` first), then the usual install locations.
fn candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("QUORUMLOCK_REDIS_SERVER").filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let names = ["redis-server", "valkey-server"];
    let mut found: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .flat_map(|dir| names.map(|n| dir.join(n)))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    for dir in ["/usr/bin", "/usr/local/bin", "/opt/homebrew/bin"] {
        found.extend(names.map(|n| Path::new(dir).join(n)));
    }
    let mut seen = std::collections::HashSet::new();
    found.retain(|p| seen.insert(p.clone()));
    found
}

/// `("Redis" | "Valkey", version)` from a server's `--version` line, e.g.
/// "Valkey server v=9.1.2 sha=…" (a Valkey binary keeps saying "Valkey" when installed
/// under the name `redis-server`).
pub(crate) fn server_version(version_output: &str) -> Option<(&'static str, &str)> {
    ["Redis", "Valkey"].into_iter().find_map(|name| {
        let rest = version_output
            .trim()
            .strip_prefix(name)?
            .strip_prefix(" server v=")?;
        Some((name, rest.split_whitespace().next().unwrap_or("")))
    })
}

impl ProcessEnv {
    /// The server binary this backend runs.
    pub(crate) fn bin(&self) -> &Path {
        &self.bin
    }

    /// "Valkey 9.1.2 (/path/valkey-server)".
    pub(crate) fn describe(&self) -> String {
        format!("{} ({})", self.server, self.bin.display())
    }
}

/// Whether a process's command line (from /proc, NULs as spaces) is a Redis or Valkey
/// server's: what the orphan sweep may kill.
/// `bin` is this run's binary, which may have another name.
pub(crate) fn is_server_cmdline(cmdline: &str, bin: &Path) -> bool {
    let own = bin
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("redis-server");
    ["redis-server", "valkey-server", own]
        .iter()
        .any(|n| cmdline.contains(n))
}

/// Kills servers (redis-server, valkey-server) whose owning test process (same host) is gone. A pid file holds
/// `"<redis pid> <owner tag>"`.
fn sweep_orphans(dir: &Path, bin: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let host = super::hostname();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(stem) = name.strip_suffix(".pid") else {
            continue;
        };
        let Ok(content) = fs::read_to_string(e.path()) else {
            continue;
        };
        let Some((pid, owner)) = content.trim().split_once(' ') else {
            continue;
        };
        if owner.split('/').next() != Some(host.as_str()) || owner_alive(owner) {
            continue;
        }
        let port = stem.rsplit('-').next().unwrap_or("");
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if is_server_cmdline(&cmdline, bin) && !port.is_empty() && cmdline.contains(port) {
            let _ = signal(pid, "KILL");
        }
        let _ = fs::remove_file(e.path());
        let _ = fs::remove_file(dir.join(format!("{stem}.log")));
        let _ = fs::remove_dir_all(dir.join(format!("{stem}.d")));
    }
}

pub(crate) struct ProcessNode {
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
    paused: bool,
    log: PathBuf,
    pidfile: PathBuf,
    workdir: PathBuf,
    /// Extra environment for redis-server (e.g. libfaketime's).
    extra_env: Vec<(String, String)>,
}

impl ProcessNode {
    pub(crate) fn start(env: &ProcessEnv, port: u16) -> Result<ProcessNode, String> {
        Self::start_with_env(env, port, Vec::new())
    }

    pub(crate) fn start_with_env(
        env: &ProcessEnv,
        port: u16,
        extra_env: Vec<(String, String)>,
    ) -> Result<ProcessNode, String> {
        let stem = format!("{}-{port}", std::process::id());
        let workdir = env.dir.join(format!("{stem}.d"));
        fs::create_dir_all(&workdir)
            .map_err(|e| format!("cannot create {}: {e}", workdir.display()))?;
        let mut node = ProcessNode {
            bin: env.bin.clone(),
            port,
            child: None,
            paused: false,
            log: env.dir.join(format!("{stem}.log")),
            pidfile: env.dir.join(format!("{stem}.pid")),
            workdir,
            extra_env,
        };
        match node.spawn() {
            Ok(()) => Ok(node),
            Err(e) => {
                node.cleanup_files();
                Err(e)
            }
        }
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = fs::File::create(&self.log)
            .map_err(|e| format!("cannot create {}: {e}", self.log.display()))?;
        let log2 = log
            .try_clone()
            .map_err(|e| format!("cannot dup log file: {e}"))?;
        let port = self.port.to_string();
        let child = Command::new(&self.bin)
            .args(["--port", &port, "--bind", "127.0.0.1"])
            .args(super::THROWAWAY)
            .args(["--daemonize", "no", "--logfile", ""])
            .arg("--dir")
            .arg(&self.workdir)
            .current_dir(&self.workdir)
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.bin.display()))?;
        let _ = fs::write(&self.pidfile, format!("{} {}", child.id(), owner_tag()));
        self.child = Some(child);
        self.paused = false;
        let child = self.child.as_mut().expect("just spawned");
        let r = wait_for_ping("127.0.0.1", self.port, START_LIMIT, || {
            match child.try_wait() {
                Ok(Some(status)) => Err(format!("exited ({status})")),
                _ => Ok(()),
            }
        });
        match r {
            Ok(_) => Ok(()),
            Err(e) => {
                self.kill();
                // The server's own words (why it stopped), not only its exit status.
                Err(format!(
                    "{} on port {port} did not start: {e}\n{}",
                    self.bin.display(),
                    super::log_excerpt(&self.log)
                ))
            }
        }
    }

    fn pid(&self) -> Result<String, String> {
        self.child
            .as_ref()
            .map(|c| c.id().to_string())
            .ok_or_else(|| format!("node on port {} is stopped", self.port))
    }

    /// SIGKILL + wait (no zombie). Works on a SIGSTOPped process too.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.paused = false;
    }

    pub(crate) fn stop(&mut self) -> Result<(), String> {
        self.kill();
        Ok(())
    }

    pub(crate) fn restart(&mut self) -> Result<(), String> {
        self.kill();
        // The port was ours a moment ago; if something grabbed it meanwhile, give it a
        // little time before failing.
        let mut last = String::new();
        for _ in 0..5 {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(last)
    }

    pub(crate) fn pause(&mut self) -> Result<(), String> {
        let pid = self.pid()?;
        signal(&pid, "STOP")?;
        self.paused = true;
        Ok(())
    }

    pub(crate) fn unpause(&mut self) -> Result<(), String> {
        let pid = self.pid()?;
        signal(&pid, "CONT")?;
        self.paused = false;
        Ok(())
    }

    /// Final teardown (Drop of the cluster).
    pub(crate) fn remove(mut self) {
        self.kill();
        self.cleanup_files();
    }

    fn cleanup_files(&self) {
        let _ = fs::remove_file(&self.pidfile);
        let _ = fs::remove_file(&self.log);
        let _ = fs::remove_dir_all(&self.workdir);
    }
}

impl Drop for ProcessNode {
    fn drop(&mut self) {
        // Backstop for paths that do not go through `remove` (e.g. a failed start).
        self.kill();
    }
}

/// `kill -s SIG pid` through /bin/sh's builtin (no libc crate, no procps needed).
fn signal(pid: &str, sig: &str) -> Result<(), String> {
    run_cmd(
        Command::new("/bin/sh").args(["-c", "kill -s \"$0\" \"$1\"", sig, pid]),
        Duration::from_secs(5),
    )
    .map(|_| ())
}
