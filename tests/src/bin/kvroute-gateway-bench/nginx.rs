//! nginx (Debian's package) as a second peer: one worker process, a streaming reverse proxy to
//! the bench's engine over kept-alive upstream connections (`proxy_buffering off`), no access
//! log, everything in a temporary prefix, under the harness supervisor.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kvroute_tests::{ChildGuard, Supervised, find_binary, free_port};

/// A running nginx.
#[derive(Debug)]
pub struct Nginx {
    pub addr: SocketAddr,
    child: ChildGuard,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// nginx's binary, if installed (`KVROUTE_NGINX`, `.tools/bin`, `PATH`, then `/usr/sbin`).
pub fn find() -> Option<PathBuf> {
    find_binary("nginx", "KVROUTE_NGINX").ok().or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/nginx");
        sbin.is_file().then_some(sbin)
    })
}

/// Whether this process runs as root (nginx then needs `user root;` to use the temp dirs).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            // "Uid:\treal\teffective\t…"
            let line = s.lines().find(|l| l.starts_with("Uid:"))?;
            line.split_whitespace().nth(2).map(|e| e == "0")
        })
        .unwrap_or(false)
}

fn config(dir: &std::path::Path, listen: u16, engine: SocketAddr) -> String {
    let d = dir.display();
    let user = if is_root() { "user root;\n" } else { "" };
    format!(
        "{user}worker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n\
           access_log off;\n\
           client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
           client_max_body_size 64m; client_body_buffer_size 1m;\n\
           keepalive_requests 1000000;\n\
           upstream engine {{ server {engine}; keepalive 256; keepalive_requests 1000000; }}\n\
           server {{\n\
             listen 127.0.0.1:{listen};\n\
             location / {{\n\
               proxy_pass http://engine;\n\
               proxy_http_version 1.1;\n\
               proxy_set_header Connection \"\";\n\
               proxy_buffering off;\n\
             }}\n\
           }}\n\
         }}\n"
    )
}

impl Nginx {
    /// Starts nginx in front of `engine`.
    pub fn start(bin: PathBuf, engine: SocketAddr) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("kvroute-nginx-")
            .tempdir()?;
        let port = free_port();
        let conf = dir.path().join("nginx.conf");
        std::fs::write(&conf, config(dir.path(), port, engine))?;
        let log = dir.path().join("nginx.out");
        let spec = Supervised::new(
            bin,
            vec![
                "-e".into(),
                dir.path().join("error.log").display().to_string(),
                "-p".into(),
                dir.path().display().to_string(),
                "-c".into(),
                conf.display().to_string(),
                "-g".into(),
                "daemon off;".into(),
            ],
            &log,
        );
        let child = spec.spawn()?;
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let start = Instant::now();
        while TcpStream::connect(addr).is_err() {
            if start.elapsed() > Duration::from_secs(10) || !child.is_running() {
                let err = std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
                let out = std::fs::read_to_string(&log).unwrap_or_default();
                bail!("nginx did not start:\n{out}\n{err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self {
            addr,
            child,
            log,
            _dir: dir,
        })
    }

    /// The master's and the workers' process ids.
    pub fn pids(&self) -> Vec<i32> {
        let master = self.child.pid();
        let mut out = vec![master];
        let children = format!("/proc/{master}/task/{master}/children");
        if let Ok(text) = std::fs::read_to_string(children) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
        out
    }

    pub fn stop(self) -> anyhow::Result<()> {
        self.child
            .stop()
            .with_context(|| std::fs::read_to_string(&self.log).unwrap_or_default())
    }
}
