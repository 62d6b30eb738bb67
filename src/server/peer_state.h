// What a readable socket holds, told apart without consuming anything: the disconnect watch of a streaming
// response (http_server.cpp) must not take a wake-up with nothing to read for a closed client.
//
// Asio's epoll reactor is edge-triggered: an EPOLLIN edge for bytes that a speculative read already consumed
// (the request's own, typically) can still be delivered later and complete a wait_read that was queued after
// them. `available() == 0` is then true although the client is still there, and treating it as a disconnect
// cancels a live request. A non-blocking MSG_PEEK tells the three cases apart: 0 bytes is an orderly close,
// EAGAIN is nothing yet (a stale edge: wait again), a byte is a pipelined request.
#pragma once

namespace dsv4::server {

enum class PeerReadState {
  kNothingYet,   // a spurious or stale wake-up: the connection is open and idle
  kDataPending,  // the client sent more (a pipelined request)
  kClosed,       // the client closed its sending side, or the connection failed (reset, ...)
};

// Peeks at socket `fd` without blocking and without consuming a byte.
PeerReadState peek_peer_state(int fd);

}  // namespace dsv4::server
