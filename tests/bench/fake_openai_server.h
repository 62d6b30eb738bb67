// A small OpenAI-style streaming server on 127.0.0.1 (ephemeral port) for the bench client's tests. A script
// decides, per request, what it does (status, token count, delays, where it breaks the stream); the server
// records what it really did (when it sent the first token, how many streams were open at once) so that tests
// compare the client's measurements with the server's facts rather than with hopes.
//
// Thread per connection with blocking Beast calls: a fixture needs to be obviously right, not fast.
#pragma once
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace dsv4::bench::testing {

struct FakeReply {
  unsigned status = 200;       // not 200: a JSON error body, no stream
  int tokens = 4;              // chunks with text ("tok0 ", "tok1 ", ...)
  double first_token_delay_s = 0.0;
  double token_gap_s = 0.0;
  bool chat = false;                     // chat chunks (delta.content) after a role-only chunk
  std::optional<int64_t> usage_tokens;   // a usage chunk before [DONE] with this completion_tokens
  int close_after_tokens = -1;           // >= 0: close the connection after that many tokens
  bool malformed_after_first = false;    // the second event is not JSON
  bool error_event_after_first = false;  // the second event is {"error": ...}
  bool send_done = true;                 // false: end the body cleanly without data: [DONE]
  bool stall_after_first = false;        // send one token, then say nothing until the server stops
  bool split_events = true;              // write each event as two HTTP chunks (the parser must join them)
};

struct ServedRequest {
  std::string target;
  std::string authorization;
  nlohmann::json body;
  double first_token_after_accept_s = -1;  // when the first token went out, after the connection was accepted
  int tokens_sent = 0;
};

class FakeOpenAiServer {
 public:
  using Script = std::function<FakeReply(const nlohmann::json& body)>;

  explicit FakeOpenAiServer(Script script) : script_(std::move(script)), acceptor_(io_) {
    using boost::asio::ip::tcp;
    const tcp::endpoint endpoint(boost::asio::ip::make_address("127.0.0.1"), 0);
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(endpoint);
    acceptor_.listen(4096);
    port_ = acceptor_.local_endpoint().port();
    accept_thread_ = std::thread([this] { accept_loop(); });
  }

  ~FakeOpenAiServer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    // Unblock accept() with a connection of our own; it sees stopping_ and returns.
    boost::beast::error_code ignored;
    boost::asio::io_context io;
    boost::asio::ip::tcp::socket poke(io);
    poke.connect({boost::asio::ip::make_address("127.0.0.1"), port_}, ignored);
    accept_thread_.join();
    for (auto& thread : connection_threads_) thread.join();
  }

  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int peak_open_streams() const { return peak_open_; }
  // Served requests keyed by the prompt (or chat message) they carried.
  std::map<std::string, ServedRequest> served() const {
    std::lock_guard lock(mutex_);
    return served_;
  }

 private:
  using Clock = std::chrono::steady_clock;

  void accept_loop() {
    for (;;) {
      boost::asio::ip::tcp::socket socket(io_);
      boost::beast::error_code error;
      acceptor_.accept(socket, error);
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      if (error) continue;
      connection_threads_.emplace_back([this, s = std::move(socket)]() mutable { serve(std::move(s)); });
    }
  }

  // Waits `seconds` unless the server is stopping; false when it is.
  bool pause(double seconds) {
    std::unique_lock lock(mutex_);
    return !wake_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return stopping_; });
  }

  static std::string prompt_of(const nlohmann::json& body) {
    if (body.contains("prompt")) return body["prompt"].get<std::string>();
    return body["messages"][0]["content"].get<std::string>();
  }

  void serve(boost::asio::ip::tcp::socket socket) {
    namespace http = boost::beast::http;
    const Clock::time_point accepted = Clock::now();
    try {
      boost::beast::flat_buffer buffer;
      http::request<http::string_body> request;
      http::read(socket, buffer, request);
      if (request.method() == http::verb::get && request.target() == "/v1/models") {
        http::response<http::string_body> response{http::status::ok, 11};
        response.set(http::field::content_type, "application/json");
        response.body() = R"({"object":"list","data":[{"id":"fake-model","object":"model"}]})";
        response.prepare_payload();
        http::write(socket, response);
        return;
      }
      const nlohmann::json body = nlohmann::json::parse(request.body());
      const std::string key = prompt_of(body);
      const FakeReply reply = script_(body);
      {
        std::lock_guard lock(mutex_);
        served_[key] = ServedRequest{std::string(request.target()),
                                     std::string(request[http::field::authorization]), body};
      }
      const int open = ++open_streams_;
      for (int peak = peak_open_; open > peak && !peak_open_.compare_exchange_weak(peak, open);) {
      }
      // The stream stops counting as open just before [DONE] goes out: from then on the client may (rightly)
      // consider the request finished and start another, while this thread still writes the last chunk.
      struct Closing {
        std::atomic<int>& open;
        bool closed = false;
        void close() {
          if (!closed) --open;
          closed = true;
        }
        ~Closing() { close(); }
      } closing{open_streams_};

      if (reply.status != 200) {
        http::response<http::string_body> response{static_cast<http::status>(reply.status), 11};
        response.set(http::field::content_type, "application/json");
        response.body() = R"({"error":{"message":"scripted failure","code":)" + std::to_string(reply.status) + "}}";
        response.prepare_payload();
        http::write(socket, response);
        return;
      }
      http::response<http::empty_body> header{http::status::ok, 11};
      header.set(http::field::content_type, "text/event-stream");
      header.chunked(true);
      http::response_serializer<http::empty_body> serializer{header};
      http::write_header(socket, serializer);
      const auto send_event = [&](const std::string& data) {
        const std::string event = "data: " + data + "\n\n";
        if (!reply.split_events) {
          boost::asio::write(socket, http::make_chunk(boost::asio::buffer(event)));
          return;
        }
        const size_t half = event.size() / 2;
        boost::asio::write(socket, http::make_chunk(boost::asio::buffer(event.data(), half)));
        boost::asio::write(socket, http::make_chunk(boost::asio::buffer(event.data() + half, event.size() - half)));
      };
      if (reply.chat)
        send_event(R"({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})");
      if (!pause(reply.first_token_delay_s)) return;
      for (int i = 0; i < reply.tokens; ++i) {
        if (i > 0 && !pause(reply.token_gap_s)) return;
        if (i == reply.close_after_tokens) return;  // the socket closes mid-stream, no last chunk
        const std::string text = "tok" + std::to_string(i) + " ";
        nlohmann::json chunk;
        if (reply.chat)
          chunk = {{"object", "chat.completion.chunk"},
                   {"choices", {{{"index", 0}, {"delta", {{"content", text}}}, {"finish_reason", nullptr}}}}};
        else
          chunk = {{"object", "text_completion"},
                   {"choices", {{{"index", 0}, {"text", text}, {"finish_reason", nullptr}}}}};
        // Timed as the token is handed to the socket, not after: a thread descheduled between the write and the
        // clock would report the token later than the client saw it (seen under ASan on 2 busy cores: 1.1 ms).
        const Clock::time_point sent = Clock::now();
        send_event(chunk.dump());
        {
          std::lock_guard lock(mutex_);
          ServedRequest& record = served_[key];
          if (record.tokens_sent++ == 0)
            record.first_token_after_accept_s = std::chrono::duration<double>(sent - accepted).count();
        }
        if (i == 0 && reply.malformed_after_first) send_event("{\"choices\": [ this is not json");
        if (i == 0 && reply.error_event_after_first)
          send_event(R"({"error":{"message":"scripted stream error","code":500}})");
        if (i == 0 && reply.stall_after_first) {
          pause(3600);
          return;
        }
      }
      if (reply.close_after_tokens >= reply.tokens) return;
      if (reply.usage_tokens)
        send_event(R"({"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":)" +
                   std::to_string(*reply.usage_tokens) + "}}");
      closing.close();
      if (reply.send_done) send_event("[DONE]");
      boost::asio::write(socket, http::make_chunk_last());
    } catch (const std::exception&) {
      // The client went away (it closes as soon as it has [DONE] or gives up): nothing to do.
    }
  }

  Script script_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::thread accept_thread_;
  std::vector<std::thread> connection_threads_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::map<std::string, ServedRequest> served_;
  std::atomic<int> open_streams_{0}, peak_open_{0};
};

}  // namespace dsv4::bench::testing
