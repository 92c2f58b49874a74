#include "launcher/coordinator/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

namespace cpd::coordinator {
namespace {

// gRPC reports a failed bind only in its log; bind a probe socket first to say why in one line
// ("Address already in use"). Addresses that are not HOST:PORT are left to gRPC.
Status CheckCanListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0) return Status::Ok();
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::Unavailable("cannot listen on '" + listen + "': " + gai_strerror(rc));
  }
  std::string error;
  bool bound = false;
  for (addrinfo* a = res; a != nullptr && !bound; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {  // as gRPC does
      if (error.empty()) error = std::strerror(errno);
    } else if (bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
      bound = true;
    } else if (error.empty()) {
      error = std::strerror(errno);
    }
    close(fd);  // a probe that carried no data: closing it cannot lose anything
  }
  freeaddrinfo(res);
  if (!bound) {
    return Status::Unavailable("cannot listen on '" + listen +
                               "': " + (error.empty() ? std::string("no usable address") : error) +
                               " (another coordinator on this port? --listen HOST:PORT, port 0 "
                               "picks a free one)");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(ServerOptions options) {
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return Status::InvalidArgument(
        "TLS needs both a certificate and its key (--tls-cert and "
        "--tls-key), or neither");
  }
  if (options.max_receive_bytes <= 0) {
    return Status::InvalidArgument("the maximum message size must be positive");
  }
  CPD_RETURN_IF_ERROR(CheckCanListen(options.listen));
  std::unique_ptr<CoordinatorServer> srv(new CoordinatorServer());
  CPD_ASSIGN_OR_RETURN(srv->store_, Store::Open(options.store));
  options.coordinator.max_response_bytes =
      std::min(options.coordinator.max_response_bytes, size_t(options.max_receive_bytes));
  CPD_ASSIGN_OR_RETURN(srv->coordinator_,
                       Coordinator::Create(srv->store_.get(), options.coordinator));

  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!options.tls_cert_pem.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({options.tls_key_pem, options.tls_cert_pem});
    creds = grpc::SslServerCredentials(ssl);
  } else {
    creds = grpc::InsecureServerCredentials();
  }
  grpc::ServerBuilder b;
  b.AddListeningPort(options.listen, creds, &srv->port_);
  b.RegisterService(srv->coordinator_->worker_service());
  b.RegisterService(srv->coordinator_->operator_service());
  b.SetMaxReceiveMessageSize(options.max_receive_bytes);
  // gRPC sets SO_REUSEPORT by default: a second coordinator on the same port would then start
  // and silently take half the connections.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Workers keep WatchSchedule open for days: probe idle connections so that a vanished client
  // does not hold a stream forever, and accept the clients' own keepalive pings.
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  srv->server_ = b.BuildAndStart();
  if (!srv->server_ || srv->port_ == 0) {
    srv->server_.reset();
    return Status::Unavailable("cannot listen on '" + options.listen +
                               "' (address in use, not local, or malformed; "
                               "--listen HOST:PORT, port 0 picks a free one)");
  }
  return srv;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::Shutdown(int grace_ms) {
  std::lock_guard<std::mutex> l(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (coordinator_) coordinator_->CloseStreams();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  }
  // Every ReportStats answered OK is in the store's queue: store it before returning.
  if (store_) store_->Flush();
}

}  // namespace cpd::coordinator
