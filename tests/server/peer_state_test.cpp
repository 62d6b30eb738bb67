// peek_peer_state against real sockets: a Unix stream pair and a TCP loopback connection, in each state the
// disconnect watch can wake in. The first case is the one `available() == 0` took for a disconnect.
#include "server/peer_state.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace dsv4::server {
namespace {

struct SocketPair {
  int server = -1, client = -1;
  ~SocketPair() {
    if (server >= 0) ::close(server);
    if (client >= 0) ::close(client);
  }
};

SocketPair unix_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  return {fds[0], fds[1]};
}

SocketPair tcp_loopback_pair() {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(::listen(listener, 1), 0);
  EXPECT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  SocketPair pair;
  pair.client = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(::connect(pair.client, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  pair.server = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  return pair;
}

int bytes_available(int fd) {
  int available = -1;
  EXPECT_EQ(::ioctl(fd, FIONREAD, &available), 0);
  return available;
}

void expect_states(SocketPair pair) {
  ASSERT_GE(pair.server, 0);
  ASSERT_GE(pair.client, 0);
  // Open and idle: nothing to read, yet the client is there. FIONREAD (asio's available()) says 0 here and
  // after a close alike, so it cannot tell them apart.
  EXPECT_EQ(bytes_available(pair.server), 0);
  EXPECT_EQ(peek_peer_state(pair.server), PeerReadState::kNothingYet);

  // A pipelined byte is reported, and the peek leaves it in place.
  ASSERT_EQ(::send(pair.client, "G", 1, 0), 1);
  EXPECT_EQ(peek_peer_state(pair.server), PeerReadState::kDataPending);
  EXPECT_EQ(peek_peer_state(pair.server), PeerReadState::kDataPending);
  char byte = 0;
  ASSERT_EQ(::recv(pair.server, &byte, 1, 0), 1);
  EXPECT_EQ(byte, 'G');
  EXPECT_EQ(peek_peer_state(pair.server), PeerReadState::kNothingYet);

  // The client closes: an orderly end of stream.
  ::shutdown(pair.client, SHUT_WR);
  EXPECT_EQ(bytes_available(pair.server), 0);
  EXPECT_EQ(peek_peer_state(pair.server), PeerReadState::kClosed);
}

TEST(PeerState, UnixStreamPair) { expect_states(unix_pair()); }

TEST(PeerState, TcpLoopback) { expect_states(tcp_loopback_pair()); }

TEST(PeerState, ResetConnectionReadsAsClosed) {
  SocketPair pair = tcp_loopback_pair();
  ASSERT_GE(pair.server, 0);
  // SO_LINGER 0: close() sends a reset instead of a FIN.
  linger abort_on_close{1, 0};
  ASSERT_EQ(::setsockopt(pair.client, SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof(abort_on_close)), 0);
  ::close(pair.client);
  pair.client = -1;
  for (int attempt = 0; attempt < 100 && peek_peer_state(pair.server) == PeerReadState::kNothingYet; ++attempt)
    ::usleep(1000);  // loopback delivers the reset at once; the loop only guards against a slow scheduler
  EXPECT_EQ(peek_peer_state(pair.server), PeerReadState::kClosed);
}

}  // namespace
}  // namespace dsv4::server
