// engine/rank_protocol.h: what the data-parallel front and its worker processes exchange. Random commands,
// reports and stats survive encode -> frame -> socket -> decode field for field (a -inf logprob included: JSON
// has no infinities); malformed messages are refused with dsv4::Error naming the field; a connection that closes
// between messages reads as the end, inside one as an error.
#include "engine/rank_protocol.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <limits>
#include <random>
#include <thread>

#include "core/error.h"

namespace dsv4 {
namespace {

using nlohmann::json;

RankCommand random_command(std::mt19937_64& rng) {
  RankCommand c;
  c.add = rng() % 3 != 0;
  c.id = rng();
  if (c.add) {
    for (int i = 0, n = 1 + static_cast<int>(rng() % 50); i < n; ++i) c.prompt.push_back(static_cast<int32_t>(rng() % 129280));
    c.params.max_tokens = 1 + static_cast<int64_t>(rng() % 4096);
    c.params.ignore_eos = rng() % 2;
    c.params.stop_token_ids = {static_cast<int32_t>(rng() % 1000)};
    c.params.temperature = std::uniform_real_distribution<double>(0, 2)(rng);
    c.params.top_k = static_cast<int64_t>(rng() % 100) - 1;
    c.params.top_p = std::uniform_real_distribution<double>(0.1, 1)(rng);
    c.params.min_p = std::uniform_real_distribution<double>(0, 0.2)(rng);
    c.params.repetition_penalty = std::uniform_real_distribution<double>(0.5, 2)(rng);
    c.params.frequency_penalty = std::uniform_real_distribution<double>(-2, 2)(rng);
    c.params.presence_penalty = std::uniform_real_distribution<double>(-2, 2)(rng);
    c.params.min_tokens = static_cast<int64_t>(rng() % 8);
    if (rng() % 2) c.params.seed = rng();
    if (rng() % 2) c.params.logprobs = static_cast<int64_t>(rng() % 20);
  }
  return c;
}

RankReport random_report(std::mt19937_64& rng) {
  RankReport r;
  r.rank = static_cast<int>(rng() % 8);
  for (int i = 0, n = static_cast<int>(rng() % 6); i < n; ++i) {
    RequestOutput o;
    o.id = rng();
    o.new_token_ids = {static_cast<int32_t>(rng() % 129280)};
    if (rng() % 2) {
      SampleResult s;
      s.token = o.new_token_ids[0];
      s.logprob = -std::uniform_real_distribution<float>(0, 30)(rng);
      s.rank = 1 + static_cast<int64_t>(rng() % 100);
      s.top = {{static_cast<int32_t>(rng() % 129280), -std::numeric_limits<float>::infinity()},
               {s.token, s.logprob}};
      o.new_logprobs.push_back(s);
    }
    o.finished = rng() % 2;
    o.status = static_cast<RequestStatus>(rng() % 6);
    if (rng() % 3 == 0) o.error = "rank " + std::to_string(rng() % 10) + " failed: \"quoted\"\n";
    o.num_cached_tokens = static_cast<int64_t>(rng() % 10000);
    r.outputs.push_back(o);
  }
  for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i)
    r.progress.push_back({rng(), static_cast<int64_t>(rng() % 100000), static_cast<int64_t>(rng() % 100000)});
  for (int i = 0, n = static_cast<int>(rng() % 5); i < n; ++i) r.events.cached.push_back(rng());
  for (int i = 0, n = static_cast<int>(rng() % 5); i < n; ++i) r.events.evicted.push_back(rng());
  r.aborts_applied = static_cast<int64_t>(rng() % 5);
  r.failed = rng() % 2;
  r.stepped = rng() % 2;
  return r;
}

void expect_equal(const RankCommand& a, const RankCommand& b) {
  EXPECT_EQ(a.add, b.add);
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.prompt, b.prompt);
  if (!a.add) return;
  const SamplingParams &p = a.params, &q = b.params;
  EXPECT_EQ(p.max_tokens, q.max_tokens);
  EXPECT_EQ(p.ignore_eos, q.ignore_eos);
  EXPECT_EQ(p.stop_token_ids, q.stop_token_ids);
  EXPECT_EQ(p.temperature, q.temperature);  // doubles round-trip exactly through nlohmann's dump
  EXPECT_EQ(p.top_k, q.top_k);
  EXPECT_EQ(p.top_p, q.top_p);
  EXPECT_EQ(p.min_p, q.min_p);
  EXPECT_EQ(p.repetition_penalty, q.repetition_penalty);
  EXPECT_EQ(p.frequency_penalty, q.frequency_penalty);
  EXPECT_EQ(p.presence_penalty, q.presence_penalty);
  EXPECT_EQ(p.seed, q.seed);
  EXPECT_EQ(p.min_tokens, q.min_tokens);
  EXPECT_EQ(p.logprobs, q.logprobs);
}

void expect_equal(const RankReport& a, const RankReport& b) {
  EXPECT_EQ(a.rank, b.rank);
  ASSERT_EQ(a.outputs.size(), b.outputs.size());
  for (size_t i = 0; i < a.outputs.size(); ++i) {
    const RequestOutput &x = a.outputs[i], &y = b.outputs[i];
    EXPECT_EQ(x.id, y.id);
    EXPECT_EQ(x.new_token_ids, y.new_token_ids);
    ASSERT_EQ(x.new_logprobs.size(), y.new_logprobs.size());
    for (size_t j = 0; j < x.new_logprobs.size(); ++j) {
      EXPECT_EQ(x.new_logprobs[j].token, y.new_logprobs[j].token);
      EXPECT_EQ(x.new_logprobs[j].logprob, y.new_logprobs[j].logprob);
      EXPECT_EQ(x.new_logprobs[j].rank, y.new_logprobs[j].rank);
      ASSERT_EQ(x.new_logprobs[j].top.size(), y.new_logprobs[j].top.size());
      for (size_t k = 0; k < x.new_logprobs[j].top.size(); ++k) {
        EXPECT_EQ(x.new_logprobs[j].top[k].token, y.new_logprobs[j].top[k].token);
        EXPECT_EQ(x.new_logprobs[j].top[k].logprob, y.new_logprobs[j].top[k].logprob);
      }
    }
    EXPECT_EQ(x.finished, y.finished);
    EXPECT_EQ(x.status, y.status);
    EXPECT_EQ(x.error, y.error);
    EXPECT_EQ(x.num_cached_tokens, y.num_cached_tokens);
  }
  ASSERT_EQ(a.progress.size(), b.progress.size());
  for (size_t i = 0; i < a.progress.size(); ++i) {
    EXPECT_EQ(a.progress[i].id, b.progress[i].id);
    EXPECT_EQ(a.progress[i].num_computed_tokens, b.progress[i].num_computed_tokens);
    EXPECT_EQ(a.progress[i].num_tokens, b.progress[i].num_tokens);
  }
  EXPECT_EQ(a.events.cached, b.events.cached);
  EXPECT_EQ(a.events.evicted, b.events.evicted);
  EXPECT_EQ(a.aborts_applied, b.aborts_applied);
  EXPECT_EQ(a.failed, b.failed);
  EXPECT_EQ(a.stepped, b.stepped);
}

// Every message goes through a real socketpair, framed, in both directions at once.
TEST(RankProtocol, RandomMessagesSurviveTheConnectionFieldForField) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  std::mt19937_64 rng(11);
  std::vector<RankCommand> commands;
  std::vector<RankReport> reports;
  std::vector<EngineStats> stats;
  for (int i = 0; i < 200; ++i) {
    commands.push_back(random_command(rng));
    reports.push_back(random_report(rng));
    EngineStats s;
    s.running = static_cast<int64_t>(rng() % 100);
    s.waiting = static_cast<int64_t>(rng() % 100);
    s.pool_bytes = static_cast<int64_t>(rng() >> 2);
    s.used_bytes = static_cast<int64_t>(rng() % 1000000);
    s.groups = {{CacheGroupKind::kC4Index, 3, 1, 64}, {CacheGroupKind::kC128State, 0, 0, 8}};
    s.prefix_hit_tokens = static_cast<int64_t>(rng() % 5000);
    stats.push_back(s);
  }
  std::thread writer([&] {
    for (size_t i = 0; i < commands.size(); ++i) {
      rank_protocol::send_message(fds[0], rank_protocol::encode(commands[i]));
      rank_protocol::send_message(fds[0], rank_protocol::encode(reports[i]));
      rank_protocol::send_message(fds[0], rank_protocol::encode(stats[i]));
    }
    ::shutdown(fds[0], SHUT_WR);
  });
  for (size_t i = 0; i < commands.size(); ++i) {
    expect_equal(commands[i], rank_protocol::decode_command(*rank_protocol::receive_message(fds[1])));
    expect_equal(reports[i], rank_protocol::decode_report(*rank_protocol::receive_message(fds[1])));
    const EngineStats got = rank_protocol::decode_stats(*rank_protocol::receive_message(fds[1]));
    EXPECT_EQ(got.running, stats[i].running);
    EXPECT_EQ(got.pool_bytes, stats[i].pool_bytes);
    EXPECT_EQ(got.used_bytes, stats[i].used_bytes);
    ASSERT_EQ(got.groups.size(), 2u);
    EXPECT_EQ(got.groups[1].kind, CacheGroupKind::kC128State);
    EXPECT_EQ(got.groups[0].capacity_blocks, 64);
    EXPECT_EQ(got.prefix_hit_tokens, stats[i].prefix_hit_tokens);
  }
  EXPECT_FALSE(rank_protocol::receive_message(fds[1]).has_value()) << "a clean close reads as the end";
  writer.join();
  ::close(fds[0]);
  ::close(fds[1]);
}

void expect_refused(const std::string& text, const std::string& names) {
  try {
    const json message = rank_protocol::parse_message(text);
    (void)rank_protocol::decode_report(message);
    FAIL() << "accepted " << text;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(names), std::string::npos) << error.what();
  }
}

TEST(RankProtocol, MalformedMessagesAreRefusedNamingTheField) {
  expect_refused("not json", "not JSON");
  expect_refused("[1,2]", "not a JSON object");
  expect_refused(R"({"rank":1})", "outputs");
  expect_refused(R"({"rank":-1,"outputs":[],"progress":[],"cached":[],"evicted":[],"aborts_applied":0,"failed":false,"stepped":false})",
                 "rank");
  expect_refused(R"({"rank":1,"outputs":[],"progress":[[1,2]],"cached":[],"evicted":[],"aborts_applied":0,"failed":false,"stepped":false})",
                 "progress");
  expect_refused(R"({"rank":1,"outputs":[],"progress":[],"cached":[-5],"evicted":[],"aborts_applied":0,"failed":false,"stepped":false})",
                 "cached");
  expect_refused(R"({"rank":1,"outputs":[],"progress":[],"cached":[],"evicted":[],"aborts_applied":1e300,"failed":false,"stepped":false})",
                 "aborts_applied");
  expect_refused(R"({"rank":1,"outputs":[{"id":1,"new_token_ids":[4294967296]}],"progress":[],"cached":[],"evicted":[],"aborts_applied":0,"failed":false,"stepped":false})",
                 "new_token_ids");
  EXPECT_THROW(rank_protocol::decode_command(rank_protocol::parse_message(R"({"add":true,"id":1,"prompt":[1]})")), Error);
  EXPECT_THROW(rank_protocol::decode_stats(rank_protocol::parse_message(
                   R"({"running":0,"waiting":0,"preemptions":0,"pool_bytes":0,"used_bytes":0,"cached_bytes":0,"groups":[[9,0,0,0]],"prefix_queries":0,"prefix_query_tokens":0,"prefix_hit_tokens":0})")),
               Error);
}

TEST(RankProtocol, AConnectionClosedInsideAMessageIsAnError) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const char header[8] = {100, 0, 0, 0, 0, 0, 0, 0};  // promises 100 bytes, sends 3
  ASSERT_EQ(::write(fds[0], header, 8), 8);
  ASSERT_EQ(::write(fds[0], "{\"a", 3), 3);
  ::shutdown(fds[0], SHUT_WR);
  EXPECT_THROW(rank_protocol::receive_message(fds[1]), Error);
  ::close(fds[0]);
  ::close(fds[1]);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const char huge[8] = {0, 0, 0, 0, 0, 0, 0, 1};  // 2^56 bytes: over the limit, refused before allocating
  ASSERT_EQ(::write(fds[0], huge, 8), 8);
  EXPECT_THROW(rank_protocol::receive_message(fds[1]), Error);
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace
}  // namespace dsv4
