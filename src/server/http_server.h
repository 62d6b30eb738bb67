// The OpenAI-compatible HTTP server (`dsv4 serve`, docs/server.md).
//
// Stack: Boost.Beast over Boost.Asio (Debian libboost-dev, header-only). Each connection is a small state
// machine on an Asio strand, so thousands of concurrent streaming clients cost a socket and a few KiB each, not
// a thread each; a few I/O threads parse JSON and tokenize, one engine thread (server/engine_service.h) runs
// the model. cpp-httplib (the other Debian option) runs a thread per connection from a fixed pool, so 500
// concurrent streams would need 500 threads or queue behind each other: it was rejected for that.
//
// Routes: POST /v1/completions, /v1/chat/completions (SSE when "stream": true), GET /v1/models, GET /health,
// GET /metrics (Prometheus), POST /tokenize, /detokenize. With an API key every /v1 route needs
// `Authorization: Bearer KEY` (401 otherwise). A client that disconnects aborts its request (its blocks are
// freed at once). SIGTERM / SIGINT stop accepting, let running requests finish, then return from run().
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "server/engine_service.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // loopback unless told otherwise
  uint16_t port = 8000;            // 0: an ephemeral port (tests); port() tells which
  std::optional<std::string> api_key;
  std::string served_model_name = "dsv4";
  int64_t max_body_bytes = int64_t{32} << 20;  // larger bodies get 413
  int io_threads = 2;
  int64_t default_completion_max_tokens = 16;  // OpenAI's default for /v1/completions
  bool handle_signals = true;                  // SIGTERM / SIGINT drain and stop
};

class HttpServer {
 public:
  // Binds and listens (throws dsv4::Error naming the address when it cannot). The service, tokenizer and
  // metrics must outlive the server.
  HttpServer(HttpServerOptions options, EngineService& service, const Tokenizer& tokenizer, ServerMetrics& metrics);
  ~HttpServer();

  uint16_t port() const;
  // Serves until shutdown() or a signal, then drains: no new connections or jobs, running jobs finish.
  void run();
  // Thread-safe: begins the graceful shutdown run() performs on SIGTERM.
  void shutdown();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::server
