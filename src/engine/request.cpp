#include "engine/request.h"

namespace dsv4 {

const char* request_status_name(RequestStatus status) {
  switch (status) {
    case RequestStatus::kWaiting: return "waiting";
    case RequestStatus::kRunning: return "running";
    case RequestStatus::kPreempted: return "preempted";
    case RequestStatus::kFinishedStopped: return "finished_stopped";
    case RequestStatus::kFinishedLength: return "finished_length";
    case RequestStatus::kFinishedAborted: return "finished_aborted";
  }
  return "?";
}

const char* finish_reason(RequestStatus status) {
  switch (status) {
    case RequestStatus::kWaiting:
    case RequestStatus::kRunning:
    case RequestStatus::kPreempted: return nullptr;
    case RequestStatus::kFinishedStopped: return "stop";
    case RequestStatus::kFinishedLength: return "length";
    case RequestStatus::kFinishedAborted: return "abort";
  }
  return nullptr;
}

}  // namespace dsv4
