//! An engine written for the tests: a tokio-tungstenite server on
//! 127.0.0.1 playing the engine's side of protocol 3 (PROTOCOL.md, section
//! 2). It runs on a thread of its own; tests drive it with blocking calls.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};

/// How the engine answers a worker's attempt to attach.
#[derive(Clone, Debug)]
pub enum Answer {
    Welcome,
    /// A first answer that is not `welcome`.
    Refuse(String),
    /// An HTTP status at the handshake (401, 403).
    Status(u16),
}

/// One accepted connection, as the test sees it.
pub struct Connection {
    pub hello: Value,
    pub headers: HashMap<String, String>,
    pub path: String,
    to_agent: mpsc::UnboundedSender<Option<Message>>,
    from_agent: std_mpsc::Receiver<Value>,
    task: tokio::task::AbortHandle,
}

impl Connection {
    pub fn send(&self, message: &Value) {
        let _ = self.to_agent.send(Some(Message::text(message.to_string())));
    }

    /// The next message from the agent within `limit`.
    pub fn recv(&self, limit: Duration) -> Option<Value> {
        self.from_agent.recv_timeout(limit).ok()
    }

    /// Messages until one matches `done` (included), within `limit`.
    pub fn until(&self, limit: Duration, done: impl Fn(&Value) -> bool) -> Vec<Value> {
        let deadline = std::time::Instant::now() + limit;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            let Some(message) = self.recv(left) else {
                break;
            };
            let finished = done(&message);
            seen.push(message);
            if finished {
                return seen;
            }
        }
        panic!("no matching message within {limit:?}; saw {seen:?}");
    }

    /// The reply (the first message that is not an event) to `call_id`.
    pub fn reply(&self, call_id: &str, limit: Duration) -> (Vec<Value>, Value) {
        let mut seen = self.until(limit, |m| {
            m["call_id"] == call_id && m.get("event").is_none()
        });
        let reply = seen.pop().expect("a reply");
        (seen, reply)
    }

    /// Sends `request` and waits for its reply.
    pub fn reply_to(&self, request: &Value, limit: Duration) -> (Vec<Value>, Value) {
        self.send(request);
        self.reply(request["call_id"].as_str().unwrap_or(""), limit)
    }

    /// A clean WebSocket close.
    pub fn close(&self) {
        let _ = self.to_agent.send(None);
    }

    /// The TCP connection dropped, no close frame.
    pub fn drop_socket(&self) {
        self.task.abort();
    }
}

pub struct Engine {
    pub url: String,
    pub port: u16,
    connections: std_mpsc::Receiver<Connection>,
    pub attempts: Arc<Mutex<usize>>,
    answer: Arc<Mutex<Answer>>,
}

impl Engine {
    pub fn start(answer: Answer) -> Engine {
        Engine::start_with(answer, None)
    }

    /// With `tls` (certificate chain and key, PEM), it listens for wss://.
    pub fn start_with(answer: Answer, tls: Option<(Vec<u8>, Vec<u8>)>) -> Engine {
        let (ready, port) = std_mpsc::channel();
        let (connections_in, connections) = std_mpsc::channel();
        let attempts = Arc::new(Mutex::new(0));
        let answer = Arc::new(Mutex::new(answer));
        let (counted, answering) = (Arc::clone(&attempts), Arc::clone(&answer));
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                ready.send(listener.local_addr().unwrap().port()).unwrap();
                let acceptor = tls.map(|(chain, key)| tls_acceptor(&chain, &key));
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    *counted.lock().unwrap() += 1;
                    let answer = answering.lock().unwrap().clone();
                    let connections_in = connections_in.clone();
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        match acceptor {
                            Some(acceptor) => {
                                if let Ok(stream) = acceptor.accept(stream).await {
                                    attach(stream, answer, connections_in).await;
                                }
                            }
                            None => attach(stream, answer, connections_in).await,
                        }
                    });
                }
            });
        });
        let port = port.recv().unwrap();
        Engine {
            url: format!("ws://127.0.0.1:{port}/api/v1/workers/attach"),
            port,
            connections,
            attempts,
            answer,
        }
    }

    pub fn set_answer(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// The next worker that attached (its hello read, the answer sent).
    pub fn next_connection(&self, limit: Duration) -> Connection {
        self.connections
            .recv_timeout(limit)
            .expect("a worker attached")
    }

    pub fn try_next_connection(&self, limit: Duration) -> Option<Connection> {
        self.connections.recv_timeout(limit).ok()
    }

    pub fn attempts(&self) -> usize {
        *self.attempts.lock().unwrap()
    }
}

// tungstenite's handshake callback returns its error as a whole response.
#[allow(clippy::result_large_err)]
async fn attach<S>(stream: S, answer: Answer, connections: std_mpsc::Sender<Connection>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let seen = Arc::new(Mutex::new((HashMap::new(), String::new())));
    let recording = Arc::clone(&seen);
    let refusal = match answer {
        Answer::Status(status) => Some(status),
        _ => None,
    };
    let callback =
        move |request: &Request, response: Response| -> Result<Response, ErrorResponse> {
            let mut seen = recording.lock().unwrap();
            for (name, value) in request.headers() {
                seen.0.insert(
                    name.as_str().to_ascii_lowercase(),
                    value.to_str().unwrap_or("").to_string(),
                );
            }
            seen.1 = request.uri().to_string();
            if let Some(status) = refusal {
                let mut refused = ErrorResponse::new(Some("this token is not known here".into()));
                *refused.status_mut() =
                    tokio_tungstenite::tungstenite::http::StatusCode::from_u16(status).unwrap();
                return Err(refused);
            }
            Ok(response)
        };
    // Messages of any size, as the engine takes a call's reply: the
    // agent's own limit (--max-reply-mb) is what the tests look at.
    let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(None)
        .max_frame_size(None);
    let accepted = tokio_tungstenite::accept_hdr_async_with_config(stream, callback, Some(config));
    let Ok(socket) = accepted.await else {
        return;
    };
    let (mut sink, mut stream) = socket.split();
    let hello = loop {
        match stream.next().await {
            Some(Ok(Message::Text(text))) => {
                break serde_json::from_str::<Value>(text.as_str()).unwrap_or(Value::Null);
            }
            Some(Ok(_)) => continue,
            _ => return,
        }
    };
    let first = match &answer {
        Answer::Refuse(reason) => json!({"op": "refused", "reason": reason}),
        _ => json!({"op": "welcome", "name": hello["name"]}),
    };
    if sink.send(Message::text(first.to_string())).await.is_err() {
        return;
    }
    let (to_agent, mut outgoing) = mpsc::unbounded_channel::<Option<Message>>();
    let (incoming, from_agent) = std_mpsc::channel();
    let pump = tokio::spawn(async move {
        loop {
            tokio::select! {
                message = outgoing.recv() => match message {
                    Some(Some(message)) => { if sink.send(message).await.is_err() { return; } }
                    Some(None) | None => { let _ = sink.close().await; return; }
                },
                message = stream.next() => match message {
                    Some(Ok(Message::Text(text))) => {
                        let value = serde_json::from_str::<Value>(text.as_str()).unwrap_or_else(|_| json!({"unparsable": text.as_str()}));
                        if incoming.send(value).is_err() { return; }
                    }
                    Some(Ok(_)) => {}
                    _ => return,
                },
            }
        }
    });
    let (headers, path) = seen.lock().unwrap().clone();
    let _ = connections.send(Connection {
        hello,
        headers,
        path,
        to_agent,
        from_agent,
        task: pump.abort_handle(),
    });
}

fn tls_acceptor(chain: &[u8], key: &[u8]) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain)
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}
