#include "server/peer_state.h"

#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>

namespace dsv4::server {

PeerReadState peek_peer_state(int fd) {
  for (;;) {
    char byte = 0;
    const ssize_t received = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (received > 0) return PeerReadState::kDataPending;
    if (received == 0) return PeerReadState::kClosed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return PeerReadState::kNothingYet;
    return PeerReadState::kClosed;  // ECONNRESET, ENOTCONN, EBADF: nobody is there to answer
  }
}

}  // namespace dsv4::server
