#include "DelegatedWork.hpp"

#include <c10/util/Exception.h>

namespace tide::torch_backend {
namespace {

// A DistBackendError as it is; any other error as a DistBackendError that begins with `what`.
std::exception_ptr as_dist_backend_error(std::exception_ptr error, const std::string& what) {
  if (!error) return error;
  try {
    std::rethrow_exception(error);
  } catch (const c10::DistBackendError&) {
    return error;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, __LINE__}, what + ": " + e.what()));
  } catch (...) {
    return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, __LINE__}, what));
  }
}

}  // namespace

DelegatedWork::DelegatedWork(c10::intrusive_ptr<c10d::Work> inner, std::string what)
    : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), what_(std::move(what)) {}

std::exception_ptr DelegatedWork::exception() const { return as_dist_backend_error(inner_->exception(), what_); }

bool DelegatedWork::wait(std::chrono::milliseconds timeout) {
  try {
    return inner_->wait(timeout);
  } catch (...) {
    std::rethrow_exception(as_dist_backend_error(std::current_exception(), what_));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> DelegatedWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (!future_) {
    c10::intrusive_ptr<c10::ivalue::Future> inner = inner_->getFuture();
    // The child future takes what its callback throws as its error.
    future_ = inner->then(
        [what = what_](c10::ivalue::Future& done) {
          if (done.hasError()) std::rethrow_exception(as_dist_backend_error(done.exception_ptr(), what));
          return done.value();
        },
        inner->elementType());
  }
  return future_;
}

}  // namespace tide::torch_backend
