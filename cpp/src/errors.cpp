#include "strideweave/errors.hpp"

namespace sw::detail {

void internal_failure(const char* condition, const char* file, int line, const std::string& message) {
  throw InternalError(concat("internal invariant '", condition, "' failed at ", file, ":", line,
                             message.empty() ? "" : ": ", message,
                             " (this is a bug in strideweave)"));
}

}  // namespace sw::detail
