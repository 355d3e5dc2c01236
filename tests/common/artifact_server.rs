//! A real HTTP artifact store on 127.0.0.1, small enough to read: `PUT
//! /artifacts?name=&media_type=` stores the body under its sha256, `GET
//! /artifacts/sha256:<hex>` serves it. Files live on disk, so gigabytes
//! cost no memory. It can demand a token, corrupt what it serves, or hang.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// How the server misbehaves, if it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Normal,
    /// Serves every artifact with its first byte changed.
    Corrupt,
    /// Reads the request and never answers.
    Hang,
}

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub target: String,
    pub headers: HashMap<String, String>,
    pub body_len: u64,
}

#[derive(Clone)]
pub struct ArtifactServer {
    pub url: String,
    pub dir: PathBuf,
    state: Arc<Mutex<State>>,
}

struct State {
    token: Option<String>,
    mode: Mode,
    seen: Vec<Seen>,
}

impl ArtifactServer {
    /// Listens on an ephemeral port; serves until the test process ends.
    pub fn start(dir: &Path, token: Option<&str>) -> ArtifactServer {
        std::fs::create_dir_all(dir).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let url = format!("http://{}/artifacts", listener.local_addr().unwrap());
        let server = ArtifactServer {
            url,
            dir: dir.to_path_buf(),
            state: Arc::new(Mutex::new(State {
                token: token.map(str::to_string),
                mode: Mode::Normal,
                seen: Vec::new(),
            })),
        };
        let serving = server.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let serving = serving.clone();
                std::thread::spawn(move || serving.handle(stream));
            }
        });
        server
    }

    pub fn set_mode(&self, mode: Mode) {
        self.state.lock().unwrap().mode = mode;
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    pub fn count(&self, method: &str) -> usize {
        self.seen().iter().filter(|s| s.method == method).count()
    }

    /// Puts a file into the store directly, as if uploaded; its digest.
    pub fn place(&self, source: &Path) -> String {
        let hex = sha256_file(source);
        std::fs::copy(source, self.dir.join(&hex)).unwrap();
        format!("sha256:{hex}")
    }

    fn handle(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut stream = stream;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let mut parts = line.split_whitespace();
            let (method, target) = (
                parts.next().unwrap_or("").to_string(),
                parts.next().unwrap_or("").to_string(),
            );
            let mut headers = HashMap::new();
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap_or(0) == 0 {
                    return;
                }
                let header = header.trim_end();
                if header.is_empty() {
                    break;
                }
                if let Some((name, value)) = header.split_once(':') {
                    headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
                }
            }
            let length: u64 = headers
                .get("content-length")
                .and_then(|l| l.parse().ok())
                .unwrap_or(0);
            let chunked = headers
                .get("transfer-encoding")
                .is_some_and(|t| t.contains("chunked"));
            // The body, hashed on its way to disk.
            let upload = self.dir.join(format!(
                ".upload-{}",
                std::process::id() as u64 * 1000 + rand_u16() as u64
            ));
            let mut hasher = Sha256::new();
            {
                let mut file = std::fs::File::create(&upload).unwrap();
                let mut left = length;
                let mut buffer = vec![0u8; 1 << 20];
                while left > 0 {
                    let want = buffer.len().min(left as usize);
                    let n = reader.read(&mut buffer[..want]).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buffer[..n]);
                    file.write_all(&buffer[..n]).unwrap();
                    left -= n as u64;
                }
            }
            let (token, mode) = {
                let mut state = self.state.lock().unwrap();
                state.seen.push(Seen {
                    method: method.clone(),
                    target: target.clone(),
                    headers: headers.clone(),
                    body_len: length,
                });
                (state.token.clone(), state.mode)
            };
            if mode == Mode::Hang {
                std::thread::sleep(std::time::Duration::from_secs(3600));
                return;
            }
            let authorized = match &token {
                None => true,
                Some(token) => headers.get("authorization") == Some(&format!("Bearer {token}")),
            };
            let answered = if !authorized {
                let _ = std::fs::remove_file(&upload);
                respond(
                    &mut stream,
                    401,
                    b"that token is not valid here\nsecond line\n",
                )
            } else if method == "PUT" && chunked {
                let _ = std::fs::remove_file(&upload);
                respond(&mut stream, 411, b"a Content-Length is required\n")
            } else if method == "PUT" {
                let hex: String = hasher
                    .finalize()
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                std::fs::rename(&upload, self.dir.join(&hex)).unwrap();
                respond(
                    &mut stream,
                    201,
                    format!("{{\"digest\": \"sha256:{hex}\"}}\n").as_bytes(),
                )
            } else if method == "GET" {
                let _ = std::fs::remove_file(&upload);
                let hex = target
                    .rsplit_once("sha256:")
                    .map(|(_, h)| h.to_string())
                    .unwrap_or_default();
                let path = self.dir.join(&hex);
                if hex.len() == 64 && path.is_file() {
                    serve_file(&mut stream, &path, mode == Mode::Corrupt)
                } else {
                    respond(&mut stream, 404, b"no such artifact\n")
                }
            } else {
                respond(&mut stream, 405, b"method not allowed\n")
            };
            if answered.is_err() {
                return;
            }
        }
    }
}

fn rand_u16() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn respond(stream: &mut TcpStream, status: u16, body: &[u8]) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)
}

fn serve_file(stream: &mut TcpStream, path: &Path, corrupt: bool) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let length = file.metadata()?.len();
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n"
    )?;
    let mut buffer = vec![0u8; 1 << 20];
    let mut first = true;
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            return Ok(());
        }
        if first && corrupt {
            buffer[0] ^= 0xff;
        }
        first = false;
        stream.write_all(&buffer[..n])?;
    }
}

pub fn sha256_file(path: &Path) -> String {
    let mut file = std::fs::File::open(path).unwrap();
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn sha256_bytes(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
