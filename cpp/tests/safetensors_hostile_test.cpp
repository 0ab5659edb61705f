// Hostile safetensors headers and files, in C++ (so that `make sanitize` runs them too): nesting 100,000 deep is
// a ValueError (Note [A header is parsed in linear time and bounded depth] in cpp/src/checkpoint/safetensors.cpp),
// quoted values are cut short, a header of many entries parses in linear time, and a FIFO is refused by every
// open (Note [Opening never blocks] in cpp/src/io.cpp).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fcntl.h>

#include "strideweave/carriers/storage.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/io.hpp"
#include "test_support.hpp"

using namespace sw;
using namespace sw::testing_support;
namespace st = sw::safetensors;

namespace {


st::Header parse(const std::string& header) {
  const std::string bytes = le64(header.size()) + header;
  return st::parse_header(bytes, bytes.size(), "ckpt.safetensors");
}

std::string nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// The ValueError message of parsing `header` ("" when it parses).
std::string refusal(const std::string& header) {
  try {
    parse(header);
  } catch (const ValueError& e) {
    return e.what();
  }
  return {};
}

// A FIFO at a fresh temporary path, removed on destruction.
struct Fifo {
  std::string path;
  Fifo() {
    TempPath p("sw-fifo");
    path = p.path() + ".fifo";
    if (::mkfifo(path.c_str(), 0600) != 0) throw std::runtime_error("mkfifo failed");
  }
  ~Fifo() { ::unlink(path.c_str()); }
};

}  // namespace

TEST(SafetensorsHostile, NestingOneHundredThousandDeepIsAValueError) {
  const std::string deep = nested(100000);
  for (const std::string& header : {R"({"__metadata__":{"k":)" + deep + "}}", R"({"t":)" + deep + "}",
                                    R"({"t":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})"}) {
    const std::string message = refusal(header);
    EXPECT_NE(message.find("ckpt.safetensors: the header nests objects and lists deeper than 128 levels"),
              std::string::npos)
        << message.substr(0, 300);
    EXPECT_LT(message.size(), 200u);
  }
}

TEST(SafetensorsHostile, NestingUpToTheBoundParsesAndOneMoreIsRefused) {
  // The header object, __metadata__'s object, then 126 lists: 128 levels.
  EXPECT_SW_THROW(ValueError, "__metadata__ must map strings to strings; 'k' holds [[[",
                  parse(R"({"__metadata__":{"k":)" + nested(126) + "}}"));
  EXPECT_SW_THROW(ValueError, "deeper than 128 levels", parse(R"({"__metadata__":{"k":)" + nested(127) + "}}"));
}

TEST(SafetensorsHostile, AQuotedValueIsCutShort) {
  std::string list = "[0";
  for (int i = 0; i < 100000; ++i) list += ",123456789";
  list += "]";
  const std::string message = refusal(R"({"__metadata__":{"k":)" + list + "}}");
  EXPECT_NE(message.find("'k' holds [0, 123456789, "), std::string::npos) << message.substr(0, 300);
  EXPECT_LT(message.size(), 400u);
  const std::string name(1000000, 'n');
  const std::string named = refusal("{\"" + name + R"(":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})");
  EXPECT_NE(named.find("tensor 'nnnn"), std::string::npos);
  EXPECT_LT(named.size(), 600u);
}

TEST(SafetensorsHostile, RepeatedNamesAreRefused) {
  const std::string e = R"({"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  EXPECT_SW_THROW(ValueError, R"(names "a" twice)", parse(R"({"a":)" + e + R"(,"b":)" + e + R"(,"a":)" + e + "}"));
  EXPECT_SW_THROW(ValueError, R"(names "__metadata__" twice)",
                  parse(R"({"__metadata__":{},"a":)" + e + R"(,"__metadata__":{}})"));
  EXPECT_SW_THROW(ValueError, R"(names "x" twice)", parse(R"({"__metadata__":{"x":"1","x":"2"}})"));
}

TEST(SafetensorsHostile, ManyEntriesParseInLinearTime) {
  // 4x the entries within 8x the time (the callback parser took 16x; best of three each).
  auto header = [](int n) {
    std::string h = "{";
    for (int i = 0; i < n; ++i)
      h += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
    return h + "}";
  };
  auto best = [&](const std::string& h, size_t n) {
    double s = 1e9;
    for (int r = 0; r < 3; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_EQ(parse(h).tensors.size(), n);
      s = std::min(s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return s;
  };
  const std::string small = header(5000), large = header(20000);
  best(small, 5000);  // warm
  const double ratio = best(large, 20000) / best(small, 5000);
  EXPECT_LT(ratio, 8.0) << "4x the entries took " << ratio << "x the time";
}

TEST(SafetensorsHostile, AFifoIsRefusedByEveryOpen) {
  Fifo fifo;
  // A read-write open of a FIFO never blocks on Linux, so these fail rather than hang should the check regress.
  EXPECT_SW_THROW(ValueError, fifo.path + " is a FIFO (named pipe), not a regular file: a regular file was expected",
                  io::try_open_file(fifo.path, O_RDWR));
  EXPECT_SW_THROW(ValueError, "a regular file was expected", io::open_file(fifo.path, O_RDWR | O_CREAT));
  EXPECT_SW_THROW(ValueError, "a regular file was expected", FileBackedCarrier(fifo.path, DType::Float32(), true));
  EXPECT_SW_THROW(ValueError, "a regular file was expected", BlockDevice(fifo.path));
  struct stat st {};
  ASSERT_EQ(::stat(fifo.path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}
