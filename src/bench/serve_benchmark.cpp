#include "bench/serve_benchmark.h"

#include <sys/resource.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench/openai_stream.h"
#include "bench/sse_parser.h"
#include "core/error.h"

namespace dsv4::bench {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::chrono::nanoseconds to_duration(double seconds) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds));
}

std::string host_header(const HttpUrl& url) {
  const bool ipv6 = url.host.find(':') != std::string::npos;
  return (ipv6 ? "[" + url.host + "]" : url.host) + ":" + std::to_string(url.port);
}

tcp::resolver::results_type resolve(asio::io_context& io, const HttpUrl& url) {
  tcp::resolver resolver(io);
  beast::error_code error;
  auto endpoints = resolver.resolve(url.host, std::to_string(url.port), error);
  DSV4_CHECK(!error, "cannot resolve " + url.host + ": " + error.message());
  return endpoints;
}

// Thousands of concurrent streams need as many sockets; the default soft limit (often 1024) is raised to the
// hard one.
void raise_open_file_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

std::string request_body(const ServeBenchmarkConfig& config, ApiKind api, const BenchmarkRequest& request) {
  json body = {{"model", config.model},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"temperature", config.temperature},
               {"max_tokens", request.max_tokens}};
  if (api == ApiKind::kChatCompletions) {
    body["messages"] = json::array({{{"role", "user"}, {"content", request.prompt}}});
    body["max_completion_tokens"] = request.max_tokens;  // the current chat name; max_tokens is its old alias
  } else {
    body["prompt"] = request.prompt;
  }
  if (config.ignore_eos) body["ignore_eos"] = true;
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

// One streaming request on its own connection: connect, send, read the header, then read the body as it
// arrives and time each SSE event. Owns itself through shared_ptr while an operation is pending.
class StreamingRequest : public std::enable_shared_from_this<StreamingRequest> {
 public:
  StreamingRequest(asio::io_context& io, const tcp::resolver::results_type& endpoints,
                   http::request<http::string_body> request, ApiKind api, Clock::time_point benchmark_start,
                   double idle_timeout_s, RequestResult& result, std::function<void()> on_finished)
      : stream_(io),
        endpoints_(endpoints),
        request_(std::move(request)),
        api_(api),
        benchmark_start_(benchmark_start),
        idle_timeout_(to_duration(idle_timeout_s)),
        result_(result),
        on_finished_(std::move(on_finished)) {}

  void start() {
    start_ = Clock::now();
    result_.start_s = seconds_between(benchmark_start_, start_);
    stream_.expires_after(idle_timeout_);
    stream_.async_connect(endpoints_, [self = shared_from_this()](beast::error_code error, const tcp::endpoint&) {
      self->on_connect(error);
    });
  }

 private:
  void on_connect(beast::error_code error) {
    if (error) return fail("connection error: " + error.message());
    stream_.expires_after(idle_timeout_);
    http::async_write(stream_, request_, [self = shared_from_this()](beast::error_code error, size_t) {
      self->on_write(error);
    });
  }

  void on_write(beast::error_code error) {
    if (error) return fail("sending the request: " + error.message());
    // A stream is as long as the generation; the idle timeout bounds it. Not boost::none: Boost 1.74 compares
    // a Content-Length against an empty optional as "exceeded" and fails every non-chunked response.
    parser_.body_limit(std::numeric_limits<std::uint64_t>::max());
    stream_.expires_after(idle_timeout_);
    http::async_read_header(stream_, buffer_, parser_, [self = shared_from_this()](beast::error_code error, size_t) {
      self->on_header(error);
    });
  }

  void on_header(beast::error_code error) {
    if (error) return fail("reading the response header: " + error.message());
    status_ = parser_.get().result_int();
    read_body();
  }

  void read_body() {
    parser_.get().body().data = body_buffer_.data();
    parser_.get().body().size = body_buffer_.size();
    stream_.expires_after(idle_timeout_);
    http::async_read_some(stream_, buffer_, parser_, [self = shared_from_this()](beast::error_code error, size_t) {
      self->on_body(error);
    });
  }

  void on_body(beast::error_code error) {
    if (finished_) return;
    const Clock::time_point now = Clock::now();
    const size_t received = body_buffer_.size() - parser_.get().body().size;
    if (error == http::error::need_buffer) error = {};  // the body buffer filled up; more follows
    const std::string_view bytes(body_buffer_.data(), received);
    if (status_ != 200) {
      // An error response: keep the start of its body for the message, then fail when it ends.
      constexpr size_t kMaxErrorBody = 1024;
      error_body_.append(bytes.substr(0, kMaxErrorBody - std::min(kMaxErrorBody, error_body_.size())));
      if (error || parser_.is_done()) return fail("HTTP " + std::to_string(status_) + ": " + error_body_);
      return read_body();
    }
    consume(bytes, now);
    if (finished_) return;
    if (error == beast::error::timeout)
      return fail("timeout: the connection was silent for " +
                  std::to_string(std::chrono::duration<double>(idle_timeout_).count()) + " s");
    if (error) return fail("stream cut off after " + std::to_string(result_.token_events) +
                           " token events: " + error.message());
    if (parser_.is_done())
      return fail("stream ended without data: [DONE] after " + std::to_string(result_.token_events) +
                  " token events");
    read_body();
  }

  // Feeds body bytes to the SSE parser and accounts for every event they complete.
  void consume(std::string_view bytes, Clock::time_point now) {
    events_.clear();
    try {
      sse_.feed(bytes, events_);
    } catch (const Error& e) {
      return fail(std::string("bad SSE stream: ") + e.what());
    }
    for (const SseEvent& event : events_) {
      const StreamPayload payload = decode_stream_payload(event.data, api_);
      if (payload.error) return fail(*payload.error);
      if (payload.is_token_event()) {
        if (result_.token_events == 0) result_.ttft_s = seconds_between(start_, now);
        else result_.itl_s.push_back(seconds_between(last_token_, now));
        last_token_ = now;
        ++result_.token_events;
        result_.generated_text += payload.text;
      }
      if (payload.completion_tokens) {
        result_.usage_reported = true;
        result_.output_tokens = *payload.completion_tokens;
      }
      if (payload.done) return succeed();
    }
  }

  void succeed() {
    if (result_.token_events == 0) return fail("stream ended (data: [DONE]) without any generated text");
    result_.e2e_s = seconds_between(start_, last_token_);
    if (!result_.usage_reported) result_.output_tokens = result_.token_events;
    result_.success = true;
    finish();
  }

  void fail(std::string message) {
    if (finished_) return;
    result_.success = false;
    result_.error = std::move(message);
    finish();
  }

  void finish() {
    finished_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    on_finished_();
  }

  beast::tcp_stream stream_;
  const tcp::resolver::results_type& endpoints_;
  http::request<http::string_body> request_;
  ApiKind api_;
  Clock::time_point benchmark_start_, start_, last_token_;
  std::chrono::nanoseconds idle_timeout_;
  RequestResult& result_;
  std::function<void()> on_finished_;

  beast::flat_buffer buffer_;
  http::response_parser<http::buffer_body> parser_;
  std::array<char, 16384> body_buffer_{};
  unsigned status_ = 0;
  std::string error_body_;
  SseParser sse_;
  std::vector<SseEvent> events_;
  bool finished_ = false;
};

// Releases requests at their arrival times, holds them while max_concurrency are in flight, and collects the
// results. Everything runs on the one thread that calls run().
class BenchmarkDriver {
 public:
  BenchmarkDriver(const ServeBenchmarkConfig& config, const std::vector<BenchmarkRequest>& requests,
                  const ProgressCallback& progress)
      : config_(config),
        requests_(requests),
        progress_(progress),
        url_(parse_base_url(config.base_url)),
        api_(api_kind_of_endpoint(config.endpoint)),
        endpoints_(resolve(io_, url_)),
        timer_(io_) {
    DSV4_CHECK(!config.max_concurrency || *config.max_concurrency >= 1,
               "--max-concurrency must be >= 1, got " + std::to_string(config.max_concurrency.value_or(0)));
    DSV4_CHECK(config.idle_timeout_s > 0, "the idle timeout must be > 0 s");
    offsets_ = arrival_offsets(static_cast<int64_t>(requests.size()), config.request_rate, config.burstiness,
                               config.seed);
    run_.results.resize(requests.size());
  }

  ServeBenchmarkRun run() {
    raise_open_file_limit();
    start_ = end_ = Clock::now();
    release_due_requests();
    io_.run();
    run_.duration_s = seconds_between(start_, end_);
    return std::move(run_);
  }

 private:
  // Queues every request whose arrival time has come, starts what the concurrency limit allows, and sleeps
  // until the next arrival.
  void release_due_requests() {
    const double elapsed = seconds_between(start_, Clock::now());
    while (next_arrival_ < offsets_.size() && offsets_[next_arrival_] <= elapsed) waiting_.push_back(next_arrival_++);
    start_waiting_requests();
    if (next_arrival_ == offsets_.size()) return;
    timer_.expires_at(start_ + to_duration(offsets_[next_arrival_]));
    timer_.async_wait([this](beast::error_code error) {
      if (!error) release_due_requests();
    });
  }

  void start_waiting_requests() {
    while (!waiting_.empty() && (!config_.max_concurrency || in_flight_ < *config_.max_concurrency)) {
      const size_t index = waiting_.front();
      waiting_.pop_front();
      ++in_flight_;
      const BenchmarkRequest& request = requests_[index];
      RequestResult& result = run_.results[index];
      result.prompt_len = request.prompt_len;
      std::make_shared<StreamingRequest>(io_, endpoints_, http_request(request), api_, start_, config_.idle_timeout_s,
                                         result, [this, index] { on_request_finished(index); })
          ->start();
    }
  }

  void on_request_finished(size_t index) {
    --in_flight_;
    ++finished_;
    if (!run_.results[index].success) ++failed_;
    end_ = Clock::now();
    if (progress_) progress_(finished_, failed_, static_cast<int64_t>(requests_.size()));
    // Not from inside the finishing request's handler chain: start the next one on a fresh handler.
    asio::post(io_, [this] { start_waiting_requests(); });
  }

  http::request<http::string_body> http_request(const BenchmarkRequest& request) const {
    http::request<http::string_body> message{http::verb::post, url_.path_prefix + config_.endpoint, 11};
    message.set(http::field::host, host_header(url_));
    message.set(http::field::user_agent, "dsv4-bench-serve");
    message.set(http::field::content_type, "application/json");
    message.set(http::field::accept, "text/event-stream");
    if (!config_.api_key.empty()) message.set(http::field::authorization, "Bearer " + config_.api_key);
    message.keep_alive(false);
    message.body() = request_body(config_, api_, request);
    message.prepare_payload();
    return message;
  }

  const ServeBenchmarkConfig& config_;
  const std::vector<BenchmarkRequest>& requests_;
  const ProgressCallback& progress_;
  HttpUrl url_;
  ApiKind api_;
  asio::io_context io_;
  tcp::resolver::results_type endpoints_;
  asio::steady_timer timer_;
  std::vector<double> offsets_;
  size_t next_arrival_ = 0;
  std::deque<size_t> waiting_;
  int64_t in_flight_ = 0, finished_ = 0, failed_ = 0;
  Clock::time_point start_, end_;
  ServeBenchmarkRun run_;
};

}  // namespace

HttpUrl parse_base_url(const std::string& base_url) {
  constexpr std::string_view kScheme = "http://";
  DSV4_CHECK(!std::string_view(base_url).starts_with("https://"),
             "--base-url " + base_url + ": https is not supported (put a TLS proxy in front, or use http)");
  DSV4_CHECK(std::string_view(base_url).starts_with(kScheme),
             "--base-url must look like http://host[:port][/prefix], got '" + base_url + "'");
  std::string_view rest = std::string_view(base_url).substr(kScheme.size());
  const size_t slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  HttpUrl url;
  if (slash != std::string_view::npos) url.path_prefix = std::string(rest.substr(slash));
  while (!url.path_prefix.empty() && url.path_prefix.back() == '/') url.path_prefix.pop_back();
  std::string_view port;
  if (authority.starts_with('[')) {  // [IPv6 literal]:port
    const size_t close = authority.find(']');
    DSV4_CHECK(close != std::string_view::npos, "--base-url " + base_url + ": unterminated '[' in the host");
    url.host = std::string(authority.substr(1, close - 1));
    const std::string_view after = authority.substr(close + 1);
    DSV4_CHECK(after.empty() || after.front() == ':', "--base-url " + base_url + ": junk after the host");
    if (!after.empty()) port = after.substr(1);
  } else {
    const size_t colon = authority.find(':');
    url.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port = authority.substr(colon + 1);
  }
  DSV4_CHECK(!url.host.empty(), "--base-url " + base_url + ": no host");
  if (!port.empty()) {
    int value = 0;
    for (const char c : port) {
      DSV4_CHECK(c >= '0' && c <= '9' && value <= 65535, "--base-url " + base_url + ": bad port");
      value = value * 10 + (c - '0');
    }
    DSV4_CHECK(value >= 1 && value <= 65535, "--base-url " + base_url + ": port out of range");
    url.port = static_cast<uint16_t>(value);
  }
  return url;
}

ServeBenchmarkRun run_serve_benchmark(const ServeBenchmarkConfig& config, const std::vector<BenchmarkRequest>& requests,
                                      const ProgressCallback& progress) {
  return BenchmarkDriver(config, requests, progress).run();
}

std::string fetch_first_model_id(const ServeBenchmarkConfig& config) {
  const HttpUrl url = parse_base_url(config.base_url);
  asio::io_context io;
  const auto endpoints = resolve(io, url);
  beast::tcp_stream stream(io);
  http::request<http::empty_body> request{http::verb::get, url.path_prefix + "/v1/models", 11};
  request.set(http::field::host, host_header(url));
  request.set(http::field::user_agent, "dsv4-bench-serve");
  if (!config.api_key.empty()) request.set(http::field::authorization, "Bearer " + config.api_key);
  request.keep_alive(false);
  beast::flat_buffer buffer;
  http::response<http::string_body> response;
  beast::error_code failure;
  std::string step = "connecting";
  // Asynchronous only for the timeout; the chain runs to completion inside io.run().
  stream.expires_after(to_duration(std::min(config.idle_timeout_s, 60.0)));
  stream.async_connect(endpoints, [&](beast::error_code error, const tcp::endpoint&) {
    if (error) return void(failure = error);
    step = "sending GET /v1/models";
    http::async_write(stream, request, [&](beast::error_code error, size_t) {
      if (error) return void(failure = error);
      step = "reading the /v1/models response";
      http::async_read(stream, buffer, response, [&](beast::error_code error, size_t) { failure = error; });
    });
  });
  io.run();
  const std::string where = url.host + ":" + std::to_string(url.port) + url.path_prefix + "/v1/models";
  DSV4_CHECK(!failure, "no --model given and " + step + " (" + where + ") failed: " + failure.message());
  DSV4_CHECK(response.result_int() == 200, "no --model given and GET " + where + " answered HTTP " +
                                               std::to_string(response.result_int()) + ": " + response.body());
  const json models = json::parse(response.body(), nullptr, /*allow_exceptions=*/false);
  const json* data = models.is_object() && models.contains("data") ? &models["data"] : nullptr;
  DSV4_CHECK(data && data->is_array() && !data->empty() && data->front().is_object() &&
                 data->front().contains("id") && data->front()["id"].is_string(),
             "no --model given and GET " + where + " lists no model: " + response.body().substr(0, 200));
  return data->front()["id"].get<std::string>();
}

}  // namespace dsv4::bench
