// The coordinator's server: the store, the Coordinator and a started gRPC server hosting both of
// its services, with the channel settings a long-lived control plane needs.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <string>

#include "cpd/status.h"
#include "launcher/coordinator/service.h"
#include "launcher/coordinator/store.h"

namespace cpd::coordinator {

struct ServerOptions {
  std::string listen = "127.0.0.1:50051";  // host:port; port 0 picks a free one
  StoreOptions store;                      // store.path is REQUIRED
  CoordinatorOptions coordinator;
  // TLS: PEM text of the certificate chain and private key (both or neither).
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // Larger requests are refused by gRPC with RESOURCE_EXHAUSTED.
  int max_receive_bytes = 4 << 20;
};

// The store, the coordinator and a started gRPC server.
class CoordinatorServer {
 public:
  static Result<std::unique_ptr<CoordinatorServer>> Start(ServerOptions options);
  // Shutdown() if not done yet.
  ~CoordinatorServer();

  int port() const { return port_; }
  Store* store() { return store_.get(); }
  Coordinator* coordinator() { return coordinator_.get(); }

  // Ends streams, stops accepting calls (in-flight unary calls get up to `grace_ms` to finish),
  // then stores every accepted report. Idempotent.
  void Shutdown(int grace_ms = 2000);

 private:
  CoordinatorServer() = default;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace cpd::coordinator
