#include "server/http_server.h"

#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <deque>
#include <random>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "core/error.h"
#include "server/peer_state.h"

namespace dsv4::server {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using json = nlohmann::json;

namespace {

constexpr auto kHeaderReadTimeout = std::chrono::seconds(120);  // idle keep-alive / slow-header connections

std::string random_id(const char* prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, "%s%016llx", prefix, static_cast<unsigned long long>(rng()));
  return buffer;
}

std::string dump(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

// One HTTP/1.1 chunk of a chunked body (the SSE stream is written as chunks, one per event).
std::string http_chunk(const std::string& payload) {
  char size[24];
  std::snprintf(size, sizeof size, "%zx\r\n", payload.size());
  return size + payload + "\r\n";
}

std::string sse_event(const json& value) { return http_chunk("data: " + dump(value) + "\n\n"); }

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

}  // namespace

class Session;

struct HttpServer::Impl {
  HttpServerOptions options;
  EngineService& service;
  const Tokenizer& tokenizer;
  ServerMetrics& metrics;
  net::io_context ioc;
  tcp::acceptor acceptor;
  net::signal_set signals;
  net::steady_timer drain_timer;
  std::atomic<bool> draining{false};
  std::atomic<int64_t> open_generations{0};  // generation responses not yet fully written
  int64_t created = static_cast<int64_t>(std::time(nullptr));

  Impl(HttpServerOptions opts, EngineService& svc, const Tokenizer& tok, ServerMetrics& met)
      : options(std::move(opts)), service(svc), tokenizer(tok), metrics(met), ioc(std::max(1, options.io_threads)),
        acceptor(ioc), signals(ioc), drain_timer(ioc) {}

  void accept();
  void begin_shutdown();
  void poll_drained();
};

// One client connection: read a request, answer it (a generation may stream for a long time), repeat while the
// client keeps the connection alive. Every handler runs on the connection's strand.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl& server) : server_(server), stream_(std::move(socket)) {}

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); });
  }

 private:
  struct ChoiceAccumulator {
    std::string prefix;  // echo: the prompt text
    std::string text, reasoning, content;
    ChoiceLogprobs logprobs;
    ReasoningSplitter splitter;
    int64_t text_length = 0;  // streamed completion text so far (text_offset of the next logprob)
    int64_t tokens = 0;
    std::optional<std::string> finish_reason, stop_reason;
  };

  void read_request() {
    parser_.emplace();
    parser_->body_limit(static_cast<uint64_t>(server_.options.max_body_bytes));
    parser_->header_limit(64 * 1024);
    stream_.expires_after(kHeaderReadTimeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset) {
      return close();
    }
    keep_alive_ = false;
    if (ec == http::error::body_limit) {
      return send_error(413, "request body exceeds the limit of " +
                                 std::to_string(server_.options.max_body_bytes) + " bytes");
    }
    if (ec) return send_error(400, "malformed HTTP request: " + ec.message());
    stream_.expires_never();
    reset_generation();
    request_ = parser_->release();
    keep_alive_ = request_.keep_alive();
    route();
  }

  void reset_generation() {
    generation_ = GenerationRequest();
    choices_.clear();
    job_.reset();
    usage_ = Usage();
    prompt_tokens_ = 0;
    headers_sent_ = stream_done_ = false;
  }

  bool authorized() {
    if (!server_.options.api_key) return true;
    const auto header = request_.find(http::field::authorization);
    return header != request_.end() && header->value() == "Bearer " + *server_.options.api_key;
  }

  void route() {
    const std::string target(request_.target());
    const std::string path = target.substr(0, target.find('?'));
    const bool get = request_.method() == http::verb::get, post = request_.method() == http::verb::post;
    if (starts_with(path, "/v1/") && !authorized())
      return send_error(401, "invalid or missing API key (Authorization: Bearer KEY)", {}, "AuthenticationError");
    try {
      if (path == "/health") {
        if (!get) return method_not_allowed();
        if (server_.draining) return send_error(503, "the server is shutting down");
        return send(200, "text/plain", "");
      }
      if (path == "/metrics") {
        if (!get) return method_not_allowed();
        return send(200, "text/plain; version=0.0.4; charset=utf-8", server_.metrics.render());
      }
      if (path == "/v1/models") {
        if (!get) return method_not_allowed();
        return send_json(200, models());
      }
      if (path == "/v1/completions" || path == "/v1/chat/completions") {
        if (!post) return method_not_allowed();
        return start_generation(path == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions);
      }
      if (path == "/tokenize") {
        if (!post) return method_not_allowed();
        return send_json(200, tokenize());
      }
      if (path == "/detokenize") {
        if (!post) return method_not_allowed();
        const std::vector<int32_t> ids = parse_detokenize_request(request_.body());
        for (const int32_t id : ids)
          if (id >= server_.tokenizer.vocab_size())
            throw ApiError(400, "token id " + std::to_string(id) + " is outside the tokenizer's vocabulary of " +
                                    std::to_string(server_.tokenizer.vocab_size()), "tokens");
        return send_json(200, {{"prompt", server_.tokenizer.decode(ids)}});
      }
      return send_error(404, "no route for " + std::string(request_.method_string()) + " " + path);
    } catch (const ApiError& error) {
      return send_error(error.status(), error.what(), error.param(), error.type());
    } catch (const Error& error) {
      return send_error(400, error.what());
    } catch (const std::exception& error) {
      // A bug, not the client's fault: answer 500 and keep serving every other connection.
      std::fprintf(stderr, "dsv4 serve: internal error on %s: %s\n", path.c_str(), error.what());
      return send_error(500, std::string("internal error: ") + error.what());
    }
  }

  void method_not_allowed() { send_error(405, "method " + std::string(request_.method_string()) + " not allowed"); }

  json models() const {
    json model = {{"id", server_.options.served_model_name}, {"object", "model"}, {"created", server_.created},
                  {"owned_by", "dsv4"},  {"root", server_.options.served_model_name},
                  {"max_model_len", server_.service.max_model_len()}};
    return {{"object", "list"}, {"data", json::array({model})}};
  }

  json tokenize() const {
    const TokenizeRequest parsed = parse_tokenize_request(request_.body());
    std::vector<int32_t> ids;
    if (parsed.prompt) {
      ids = server_.tokenizer.encode(*parsed.prompt, parsed.add_special_tokens);
    } else {
      ids = server_.tokenizer.encode(encode_messages(parsed.messages, parsed.chat), false);
    }
    return {{"count", ids.size()}, {"max_model_len", server_.service.max_model_len()}, {"tokens", ids}};
  }

  // ---- responses ----------------------------------------------------------------------------------------

  void send(int status, const std::string& content_type, std::string body) {
    server_.metrics.count_http(status);
    auto response = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), 11);
    response->set(http::field::server, "dsv4");
    response->set(http::field::content_type, content_type);
    response->keep_alive(keep_alive_);
    response->body() = std::move(body);
    response->prepare_payload();
    http::async_write(stream_, *response, [self = shared_from_this(), response](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->after_response();
    });
  }

  void send_json(int status, const json& body) { send(status, "application/json", dump(body)); }

  void send_error(int status, const std::string& message, const std::string& param = {},
                  const std::string& type = {}) {
    send(status, "application/json", error_body(status, message, param, type));
  }

  // The response is written: read the next request, unless a disconnect watch is still armed (then it is
  // cancelled first; two reads may not be pending on one socket).
  void after_response() {
    if (!keep_alive_) return lingering_close();
    if (watching_) {
      resume_after_watch_ = true;
      beast::error_code ignored;
      stream_.socket().cancel(ignored);
      return;
    }
    read_request();
  }

  // A response sent before the whole request was read (413, a malformed request) must not be followed by a
  // plain close: unread bytes make the kernel answer with a reset and the client loses the response. Shut the
  // sending side and discard what still arrives, for a few seconds at most (nginx's lingering close).
  void lingering_close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(std::chrono::seconds(5));
    drain_.resize(64 * 1024);
    drain_read();
  }

  void drain_read() {
    stream_.async_read_some(net::buffer(drain_), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->drain_read();
    });
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  // ---- generation ---------------------------------------------------------------------------------------

  void start_generation(Endpoint endpoint) {
    generation_ = parse_generation_request(request_.body(), endpoint);
    const GenerationRequest& request = generation_;
    if (!request.model.empty() && request.model != server_.options.served_model_name)
      throw ApiError(404, "The model `" + request.model + "` does not exist.", "model", "NotFoundError");
    const Tokenizer& tokenizer = server_.tokenizer;
    const int64_t max_model_len = server_.service.max_model_len();
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::string> echo_text;
    if (endpoint == Endpoint::kCompletions) {
      for (const PromptInput& input : request.prompts) {
        if (const auto* text = std::get_if<std::string>(&input)) {
          prompts.push_back(tokenizer.encode(*text, /*add_special_tokens=*/true));
          echo_text.push_back(*text);
        } else {
          prompts.push_back(std::get<std::vector<int32_t>>(input));
          echo_text.push_back(request.echo ? tokenizer.decode(prompts.back()) : std::string());
        }
      }
    } else {
      try {
        prompts.push_back(tokenizer.encode(encode_messages(request.messages, request.chat), false));
      } catch (const std::exception& error) {  // dsv4::Error, or a JSON type error on a malformed message
        throw ApiError(400, error.what(), "messages");
      }
      echo_text.emplace_back();
    }
    JobSpec spec;
    for (size_t p = 0; p < prompts.size(); ++p) {
      const int64_t prompt_tokens = static_cast<int64_t>(prompts[p].size());
      if (prompt_tokens == 0) throw ApiError(400, "the prompt is empty", "prompt");
      int64_t max_tokens = request.max_tokens.value_or(endpoint == Endpoint::kCompletions
                                                           ? server_.options.default_completion_max_tokens
                                                           : max_model_len - prompt_tokens);
      if (!request.max_tokens) max_tokens = std::min(max_tokens, max_model_len - prompt_tokens);
      if (max_tokens < 1 || prompt_tokens + max_tokens > max_model_len)
        throw ApiError(400,
                       "This model's maximum context length is " + std::to_string(max_model_len) +
                           " tokens. However, you requested " + std::to_string(prompt_tokens + std::max<int64_t>(max_tokens, 0)) +
                           " tokens (" + std::to_string(prompt_tokens) + " in the prompt, " +
                           std::to_string(std::max<int64_t>(max_tokens, 0)) + " in the completion).",
                       endpoint == Endpoint::kCompletions ? "prompt" : "messages");
      for (int64_t i = 0; i < request.n; ++i) {
        JobSpec::Choice choice;
        choice.prompt = prompts[p];
        choice.params = request.sampling;
        choice.params.max_tokens = max_tokens;
        if (choice.params.seed) choice.params.seed = *choice.params.seed + static_cast<uint64_t>(i);  // vLLM's n
        choice.prompt_index = static_cast<int64_t>(p);
        spec.choices.push_back(std::move(choice));
        ChoiceAccumulator& accumulator = choices_.emplace_back();
        if (request.echo) accumulator.prefix = echo_text[p];
      }
    }
    spec.stop = request.stop;
    spec.skip_special_tokens = request.skip_special_tokens;
    spec.include_stop_str_in_output = request.include_stop_str_in_output;
    response_id_ = random_id(endpoint == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-");
    created_ = static_cast<int64_t>(std::time(nullptr));
    for (const auto& prompt : prompts) prompt_tokens_ += static_cast<int64_t>(prompt.size());

    auto self = shared_from_this();
    const JobId id = server_.service.submit(std::move(spec), [self](JobUpdate update) {
      net::post(self->stream_.get_executor(),
                [self, update = std::move(update)]() mutable { self->on_update(std::move(update)); });
    });
    job_ = id;
    ++server_.open_generations;
    in_generation_ = true;
    watch_disconnect();
  }

  // A readable socket that reads as closed is a client gone: abort its request. A wake-up with nothing to read
  // is not one (a stale epoll edge, server/peer_state.h): wait again.
  void watch_disconnect() {
    watching_ = true;
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this()](beast::error_code ec) {
      self->watching_ = false;
      if (self->resume_after_watch_) {
        self->resume_after_watch_ = false;
        return self->read_request();
      }
      if (ec) return;
      switch (peek_peer_state(self->stream_.socket().native_handle())) {
        case PeerReadState::kClosed: return self->client_gone();
        case PeerReadState::kNothingYet:
          if (self->in_generation_ && !self->client_gone_) self->watch_disconnect();
          return;
        case PeerReadState::kDataPending: return;  // a pipelined request: read once this response is written
      }
    });
  }

  void client_gone() {
    if (client_gone_) return;
    client_gone_ = true;
    if (job_ && in_generation_) server_.service.cancel(*job_);
    end_generation();
    close();
  }

  void end_generation() {
    if (!in_generation_) return;
    in_generation_ = false;
    --server_.open_generations;
  }

  bool thinking() const {
    return generation_.endpoint == Endpoint::kChatCompletions &&
           generation_.chat.thinking_mode == ThinkingMode::kThinking;
  }

  json chunk_base() const {
    return {{"id", response_id_},
            {"object", generation_.endpoint == Endpoint::kCompletions ? "text_completion" : "chat.completion.chunk"},
            {"created", created_},
            {"model", server_.options.served_model_name}};
  }

  Usage current_usage() const {
    Usage usage;
    usage.prompt_tokens = prompt_tokens_;
    for (const auto& choice : choices_) usage.completion_tokens += choice.tokens;
    return usage;
  }

  void on_update(JobUpdate update) {
    if (client_gone_ || !in_generation_) return;
    if (update.error_status) {
      if (!headers_sent_) {
        end_generation();
        return send_error(update.error_status, update.error);
      }
      queue_write(sse_event(json::parse(error_body(update.error_status, update.error))));
      return finish_stream();
    }
    if (update.accepted) {
      if (!generation_.stream) return;
      headers_sent_ = true;
      queue_write(std::string("HTTP/1.1 200 OK\r\nServer: dsv4\r\nContent-Type: text/event-stream\r\n"
                              "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nConnection: ") +
                  (keep_alive_ ? "keep-alive" : "close") + "\r\n\r\n");
      server_.metrics.count_http(200);
      if (generation_.endpoint == Endpoint::kChatCompletions) {
        for (size_t i = 0; i < choices_.size(); ++i) {
          json chunk = chunk_base();
          chunk["choices"] = json::array({{{"index", i},
                                           {"delta", {{"role", "assistant"}, {"content", ""}}},
                                           {"logprobs", nullptr},
                                           {"finish_reason", nullptr}}});
          if (generation_.include_usage) chunk["usage"] = nullptr;
          queue_write(sse_event(chunk));
        }
      }
      return;
    }
    for (ChoiceUpdate& choice_update : update.choices) apply(choice_update);
    if (update.done) {
      usage_ = update.usage;
      if (generation_.stream) return finish_stream();
      end_generation();
      return send_json(200, full_response());
    }
  }

  void apply(ChoiceUpdate& update) {
    ChoiceAccumulator& choice = choices_.at(static_cast<size_t>(update.index));
    choice.tokens += static_cast<int64_t>(update.token_ids.size());
    std::string reasoning, content;
    if (thinking()) {
      ReasoningSplitter::Parts parts = choice.splitter.push(update.text);
      if (update.finish_reason) {
        ReasoningSplitter::Parts rest = choice.splitter.flush();
        parts.reasoning += rest.reasoning;
      }
      reasoning = std::move(parts.reasoning);
      content = std::move(parts.content);
    } else {
      content = update.text;
    }
    if (update.finish_reason) {
      choice.finish_reason = update.finish_reason;
      choice.stop_reason = update.stop_reason;
    }
    const bool want_logprobs = generation_.logprobs.has_value();
    if (!generation_.stream) {
      choice.text += update.text;
      choice.reasoning += reasoning;
      choice.content += content;
      if (want_logprobs) append_logprobs(choice.logprobs, update.logprobs);
      return;
    }
    if (update.text.empty() && update.logprobs.size() == 0 && !update.finish_reason) return;
    json chunk = chunk_base();
    json entry = {{"index", update.index}};
    if (generation_.endpoint == Endpoint::kCompletions) {
      std::string text = update.text;
      if (!choice.prefix.empty() && choice.text_length == 0) text = choice.prefix + text;
      entry["text"] = text;
      entry["logprobs"] = want_logprobs ? completion_logprobs_json(update.logprobs, choice.text_length) : json(nullptr);
      choice.text_length += static_cast<int64_t>(text.size());
      if (!choice.prefix.empty()) choice.prefix.clear();
    } else {
      json delta = json::object();
      if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
      if (!content.empty() || reasoning.empty()) delta["content"] = content;
      entry["delta"] = delta;
      entry["logprobs"] = want_logprobs ? chat_logprobs_json(update.logprobs) : json(nullptr);
    }
    entry["finish_reason"] = update.finish_reason ? json(*update.finish_reason) : json(nullptr);
    if (update.finish_reason) entry["stop_reason"] = update.stop_reason ? json(*update.stop_reason) : json(nullptr);
    chunk["choices"] = json::array({entry});
    if (generation_.include_usage)
      chunk["usage"] = generation_.continuous_usage_stats ? usage_json(current_usage()) : json(nullptr);
    queue_write(sse_event(chunk));
  }

  static void append_logprobs(ChoiceLogprobs& into, const ChoiceLogprobs& from) {
    into.tokens.insert(into.tokens.end(), from.tokens.begin(), from.tokens.end());
    into.token_bytes.insert(into.token_bytes.end(), from.token_bytes.begin(), from.token_bytes.end());
    into.logprobs.insert(into.logprobs.end(), from.logprobs.begin(), from.logprobs.end());
    into.top.insert(into.top.end(), from.top.begin(), from.top.end());
    into.top_bytes.insert(into.top_bytes.end(), from.top_bytes.begin(), from.top_bytes.end());
  }

  json full_response() const {
    json response = chunk_base();
    json list = json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      const ChoiceAccumulator& choice = choices_[i];
      json entry = {{"index", i}};
      const bool want_logprobs = generation_.logprobs.has_value();
      if (generation_.endpoint == Endpoint::kCompletions) {
        entry["text"] = choice.prefix + choice.text;
        entry["logprobs"] = want_logprobs ? completion_logprobs_json(choice.logprobs, 0) : json(nullptr);
      } else {
        json message = {{"role", "assistant"}, {"content", choice.content}};
        if (thinking()) message["reasoning_content"] = choice.reasoning;
        message["tool_calls"] = json::array();
        entry["message"] = message;
        entry["logprobs"] = want_logprobs ? chat_logprobs_json(choice.logprobs) : json(nullptr);
      }
      entry["finish_reason"] = choice.finish_reason ? json(*choice.finish_reason) : json(nullptr);
      entry["stop_reason"] = choice.stop_reason ? json(*choice.stop_reason) : json(nullptr);
      list.push_back(std::move(entry));
    }
    response["object"] = generation_.endpoint == Endpoint::kCompletions ? "text_completion" : "chat.completion";
    response["choices"] = std::move(list);
    response["usage"] = usage_json(usage_);
    return response;
  }

  void finish_stream() {
    if (generation_.include_usage) {
      json chunk = chunk_base();
      chunk["choices"] = json::array();
      chunk["usage"] = usage_json(usage_);
      queue_write(sse_event(chunk));
    }
    queue_write(http_chunk("data: [DONE]\n\n"));
    queue_write("0\r\n\r\n");  // the last chunk of the chunked body
    stream_done_ = true;
  }

  void queue_write(std::string data) {
    writes_.push_back(std::move(data));
    if (!writing_) write_next();
  }

  void write_next() {
    writing_ = true;
    net::async_write(stream_, net::buffer(writes_.front()), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->writing_ = false;
      if (ec) return self->client_gone();  // a write that fails is a client that went away
      self->writes_.pop_front();
      if (!self->writes_.empty()) return self->write_next();
      if (self->stream_done_) {
        self->stream_done_ = false;
        self->end_generation();
        self->after_response();
      }
    });
  }

  HttpServer::Impl& server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> request_;
  bool keep_alive_ = false;

  GenerationRequest generation_;
  std::vector<ChoiceAccumulator> choices_;
  std::optional<JobId> job_;
  std::string response_id_;
  int64_t created_ = 0, prompt_tokens_ = 0;
  Usage usage_;
  bool in_generation_ = false, headers_sent_ = false, client_gone_ = false, stream_done_ = false;
  bool watching_ = false, resume_after_watch_ = false, writing_ = false;
  std::deque<std::string> writes_;
  std::vector<char> drain_;
};

void HttpServer::Impl::accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) std::make_shared<Session>(std::move(socket), *this)->start();
    else if (ec == net::error::no_descriptors || ec == net::error::no_buffer_space)
      std::fprintf(stderr, "dsv4 serve: accept: %s\n", ec.message().c_str());
    accept();
  });
}

void HttpServer::Impl::begin_shutdown() {
  if (draining.exchange(true)) return;
  std::fprintf(stderr, "dsv4 serve: shutting down: no new requests; %lld running ones finish first\n",
               static_cast<long long>(service.active_jobs()));
  beast::error_code ignored;
  acceptor.close(ignored);
  service.begin_drain();
  poll_drained();
}

void HttpServer::Impl::poll_drained() {
  if (service.active_jobs() == 0 && open_generations.load() == 0) {
    ioc.stop();
    return;
  }
  drain_timer.expires_after(std::chrono::milliseconds(20));
  drain_timer.async_wait([this](beast::error_code) { poll_drained(); });
}

HttpServer::HttpServer(HttpServerOptions options, EngineService& service, const Tokenizer& tokenizer,
                       ServerMetrics& metrics)
    : impl_(std::make_unique<Impl>(std::move(options), service, tokenizer, metrics)) {
  // Every streaming client holds a descriptor: lift the soft limit to the hard one (often 1024 -> 1M).
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
  Impl& impl = *impl_;
  beast::error_code ec;
  const auto address = net::ip::make_address(impl.options.host, ec);
  DSV4_CHECK(!ec, "--host '" + impl.options.host + "': not an IP address (" + ec.message() + ")");
  const tcp::endpoint endpoint(address, impl.options.port);
  impl.acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl.acceptor.bind(endpoint, ec);
  if (!ec) impl.acceptor.listen(net::socket_base::max_listen_connections, ec);
  DSV4_CHECK(!ec, "cannot listen on " + impl.options.host + ":" + std::to_string(impl.options.port) + ": " +
                      ec.message());
}

HttpServer::~HttpServer() = default;

uint16_t HttpServer::port() const { return impl_->acceptor.local_endpoint().port(); }

void HttpServer::shutdown() {
  net::post(impl_->ioc, [impl = impl_.get()] { impl->begin_shutdown(); });
}

void HttpServer::run() {
  Impl& impl = *impl_;
  if (impl.options.handle_signals) {
    impl.signals.add(SIGINT);
    impl.signals.add(SIGTERM);
    impl.signals.async_wait([&impl](beast::error_code ec, int) {
      if (!ec) impl.begin_shutdown();
    });
  }
  impl.accept();
  std::vector<std::thread> threads;
  for (int i = 1; i < impl.options.io_threads; ++i) threads.emplace_back([&impl] { impl.ioc.run(); });
  impl.ioc.run();
  for (auto& thread : threads) thread.join();
}

}  // namespace dsv4::server
