// test_cxx.cc — a C++ program on hakmem (linked statically with libhakmem.a,
// so libstdc++'s operator new/delete reach hakmem's malloc/free).
//
// Tests:
//   containers      std::string/map/vector/unordered_map built in 4 std::threads;
//                   checksums equal the same work done serially.
//   exchange        4 threads pass std::unique_ptr<Payload> through mutex-
//                   protected queues: every object is deleted by a thread other
//                   than the one that allocated it; checksum is deterministic.
//   aligned_new     alignas(64) and alignas(4096) types with new/new[]/vector/
//                   make_unique, operator new(size, align_val_t), nothrow new,
//                   and bad_alloc for an impossible size.
//   exceptions      exceptions thrown and caught in 4 threads (objects from
//                   __cxa_allocate_exception, big ones and ones holding heap
//                   strings/vectors), rethrow, std::exception_ptr across threads.
//   new_delete      plain new/delete and new[]/delete[] of many sizes.
//
// The last line printed is "test_cxx: N passed, N failed".
#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

namespace {

constexpr int kThreads = 4;

uint64_t fnv(const void* data, size_t n, uint64_t h = 1469598103934665603ULL) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

uint64_t fnv(const std::string& s, uint64_t h = 1469598103934665603ULL) {
  return fnv(s.data(), s.size(), h);
}

std::string long_key(int t, int i) {
  // always longer than the small-string buffer (15 chars)
  return "thread-" + std::to_string(t) + "/key-number-" + std::to_string(i) +
         std::string(static_cast<size_t>(i % 40), static_cast<char>('a' + i % 26));
}

// ---- containers -----------------------------------------------------------
uint64_t container_work(int t, int rounds) {
  uint64_t sum = 0;
  for (int r = 0; r < rounds; r++) {
    std::map<std::string, std::vector<int>> m;
    std::unordered_map<std::string, std::string> um;
    for (int i = 0; i < 600; i++) {
      std::string k = long_key(t, (i * 7919 + r) % 1000);
      std::vector<int>& v = m[k];
      for (int j = 0; j < (i % 50); j++) v.push_back(i * j + r);
      um[k + "#u"] = k + k;
      if (i % 5 == 0) um.erase(long_key(t, (i * 31) % 1000) + "#u");
      if (i % 9 == 0) m.erase(long_key(t, (i * 13 + r) % 1000));
    }
    // ordered: checksum in key order
    uint64_t h = 1469598103934665603ULL;
    for (const auto& kv : m) {
      h = fnv(kv.first, h);
      h = fnv(kv.second.data(), kv.second.size() * sizeof(int), h);
    }
    // unordered: order-independent sum
    uint64_t u = 0;
    for (const auto& kv : um) u += mix64(fnv(kv.first) ^ fnv(kv.second));
    std::vector<std::string> keys;
    for (const auto& kv : um) keys.push_back(kv.first);
    std::sort(keys.begin(), keys.end());
    uint64_t ks = 1469598103934665603ULL;
    for (const auto& k : keys) ks = fnv(k, ks);
    sum += h ^ mix64(u + static_cast<uint64_t>(m.size())) ^ (ks * 3);
  }
  return sum;
}

// ---- exchange of unique_ptr objects between threads ----------------------
struct Payload {
  int from = 0;
  int seq = 0;
  std::string name;
  std::vector<uint64_t> data;
  std::map<int, std::string> tags;
  uint64_t checksum() const {
    uint64_t h = fnv(name);
    h = fnv(data.data(), data.size() * sizeof(uint64_t), h);
    for (const auto& kv : tags) h = fnv(kv.second, h ^ static_cast<uint64_t>(kv.first));
    return mix64(h ^ (static_cast<uint64_t>(from) << 32) ^ static_cast<uint64_t>(seq));
  }
};

std::unique_ptr<Payload> make_payload(int from, int seq) {
  auto p = std::make_unique<Payload>();
  p->from = from;
  p->seq = seq;
  p->name = "payload-from-" + std::to_string(from) + "-seq-" + std::to_string(seq);
  size_t n = static_cast<size_t>((seq * 37) % 3000);  // up to 24 KB of data
  p->data.reserve(n);
  for (size_t i = 0; i < n; i++) p->data.push_back(mix64(static_cast<uint64_t>(seq) * 1000 + i));
  for (int i = 0; i < seq % 7; i++) p->tags[i] = std::string(static_cast<size_t>(20 + i * 10), 'x');
  if (seq % 101 == 0) p->data.resize(50000 + static_cast<size_t>(from));  // a big one (400 KB)
  return p;
}

struct Queue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Payload>> q;
  void push(std::unique_ptr<Payload> p) {
    {
      std::lock_guard<std::mutex> g(mu);
      q.push_back(std::move(p));
    }
    cv.notify_one();
  }
  std::unique_ptr<Payload> pop() {
    std::unique_lock<std::mutex> g(mu);
    cv.wait(g, [this] { return !q.empty(); });
    auto p = std::move(q.front());
    q.pop_front();
    return p;
  }
  bool try_pop(std::unique_ptr<Payload>& out) {
    std::lock_guard<std::mutex> g(mu);
    if (q.empty()) return false;
    out = std::move(q.front());
    q.pop_front();
    return true;
  }
};

constexpr int kPerThread = 3000;

uint64_t expected_exchange_sum() {
  uint64_t s = 0;
  for (int t = 0; t < kThreads; t++)
    for (int i = 0; i < kPerThread; i++) s += make_payload(t, i)->checksum();
  return s;
}

// ---- exceptions -----------------------------------------------------------
struct BigError : std::exception {
  std::array<char, 8192> blob;  // a big exception object
  std::vector<int> v;           // holding heap memory too
  std::string msg;
  explicit BigError(int n) : v(static_cast<size_t>(n), n), msg(std::string(100, 'E') + std::to_string(n)) {
    blob.fill(static_cast<char>(n));
  }
  const char* what() const noexcept override { return msg.c_str(); }
};

__attribute__((noinline)) void thrower(int i) {
  switch (i % 4) {
    case 0:
      throw std::runtime_error("runtime error number " + std::to_string(i) +
                               std::string(static_cast<size_t>(i % 64), '!'));
    case 1:
      throw BigError(i % 1000);
    case 2:
      throw std::to_string(i) + std::string(40, 's');  // a std::string as the object
    default:
      throw i;
  }
}

void (*volatile g_thrower)(int) = thrower;

__attribute__((noinline)) uint64_t nested(int i, int depth) {
  std::vector<std::string> junk(3, std::string(50, 'j'));  // unwound on throw
  if (depth <= 0) {
    g_thrower(i);  // through a volatile pointer: the compiler can't see it never returns
    return 0;
  }
  return nested(i, depth - 1) + junk.size();
}

uint64_t exception_work(int t, int n) {
  uint64_t sum = 0;
  for (int i = 0; i < n; i++) {
    int k = t * 100000 + i;
    try {
      try {
        sum += nested(k, k % 5);
      } catch (const BigError& e) {
        if (e.blob[100] != static_cast<char>(k % 1000) || e.v.size() != static_cast<size_t>(k % 1000))
          return 0;
        sum += std::strlen(e.what()) * 7;
        throw;  // rethrow the same object
      }
    } catch (const std::exception& e) {
      sum += std::strlen(e.what());
    } catch (const std::string& s) {
      sum += s.size() * 3;
    } catch (int v) {
      sum += static_cast<uint64_t>(v % 17);
    }
  }
  // exception_ptr: captured here, rethrown and caught in another thread
  std::exception_ptr ep;
  try {
    thrower(t * 4);
  } catch (...) {
    ep = std::current_exception();
  }
  std::string what;
  std::thread other([&] {
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    }
  });
  other.join();
  ep = nullptr;  // last reference: freed here, allocated by this thread
  return sum + what.size();
}

// ---- aligned new ----------------------------------------------------------
struct alignas(64) Line {
  char c[100];
  uint64_t v;
};
struct alignas(4096) PageObj {
  char c[5000];
  uint64_t v;
};

template <typename T>
bool aligned_ok(const T* p) {
  return p && (reinterpret_cast<uintptr_t>(p) % alignof(T)) == 0;
}

}  // namespace

TEST(containers) {
  std::vector<uint64_t> serial(kThreads), par(kThreads), par2(kThreads);
  for (int t = 0; t < kThreads; t++) serial[t] = container_work(t, 3);
  for (int round = 0; round < 2; round++) {
    std::vector<uint64_t>& out = round ? par2 : par;
    std::vector<std::thread> th;
    for (int t = 0; t < kThreads; t++) th.emplace_back([t, &out] { out[t] = container_work(t, 3); });
    for (auto& x : th) x.join();
  }
  for (int t = 0; t < kThreads; t++) {
    CHECK(serial[t] == par[t]);
    CHECK(serial[t] == par2[t]);
  }
  uint64_t all = 0;
  for (auto v : serial) all ^= v;
  harness_say("  container checksum %016llx\n", static_cast<unsigned long long>(all));
}

TEST(exchange) {
  uint64_t expected = expected_exchange_sum();
  for (int round = 0; round < 2; round++) {
    std::vector<Queue> qs(kThreads);
    std::vector<uint64_t> sums(kThreads, 0);
    std::vector<int> foreign(kThreads, 0);
    std::vector<std::thread> th;
    for (int t = 0; t < kThreads; t++) {
      th.emplace_back([t, &qs, &sums, &foreign] {
        Queue& out = qs[(t + 1) % kThreads];
        Queue& in = qs[t];
        int got = 0;
        for (int i = 0; i < kPerThread; i++) {
          out.push(make_payload(t, i));
          std::unique_ptr<Payload> p;
          while (in.try_pop(p)) {
            if (p->from != t) foreign[t]++;
            sums[t] += p->checksum();
            p.reset();  // deleted by a thread that did not allocate it
            got++;
          }
        }
        while (got < kPerThread) {
          auto p = in.pop();
          if (p->from != t) foreign[t]++;
          sums[t] += p->checksum();
          got++;
        }  // p destroyed here
      });
    }
    for (auto& x : th) x.join();
    uint64_t total = 0;
    int nforeign = 0;
    for (int t = 0; t < kThreads; t++) {
      total += sums[t];
      nforeign += foreign[t];
    }
    CHECK(total == expected);
    CHECK_EQ(nforeign, kThreads * kPerThread);
    if (round == 0)
      harness_say("  exchanged %d objects, checksum %016llx (expected %016llx)\n",
                  kThreads * kPerThread, static_cast<unsigned long long>(total),
                  static_cast<unsigned long long>(expected));
  }
}

TEST(aligned_new) {
  static_assert(alignof(Line) == 64, "Line");
  static_assert(alignof(PageObj) == 4096, "PageObj");
  std::vector<std::thread> th;
  std::vector<int> bad(kThreads, 0);
  for (int t = 0; t < kThreads; t++) {
    th.emplace_back([t, &bad] {
      for (int i = 0; i < 300; i++) {
        Line* a = new Line;
        a->v = static_cast<uint64_t>(i);
        std::memset(a->c, i, sizeof a->c);
        PageObj* b = new PageObj;
        std::memset(b->c, t, sizeof b->c);
        Line* arr = new Line[static_cast<size_t>(1 + i % 17)];
        PageObj* parr = new PageObj[static_cast<size_t>(1 + i % 3)];
        auto up = std::make_unique<PageObj>();
        std::vector<Line> vec(static_cast<size_t>(i % 40));
        void* raw = ::operator new(static_cast<size_t>(100 + i), std::align_val_t(128));
        void* raw2 = ::operator new(static_cast<size_t>(1 + i * 100), std::align_val_t(8192));
        Line* nt = new (std::nothrow) Line;
        if (!aligned_ok(a) || !aligned_ok(b) || !aligned_ok(arr) || !aligned_ok(parr) ||
            !aligned_ok(up.get()) || (!vec.empty() && !aligned_ok(vec.data())) || !aligned_ok(nt))
          bad[t]++;
        if (reinterpret_cast<uintptr_t>(raw) % 128 || reinterpret_cast<uintptr_t>(raw2) % 8192) bad[t]++;
        std::memset(raw, 1, static_cast<size_t>(100 + i));
        std::memset(raw2, 2, static_cast<size_t>(1 + i * 100));
        if (a->v != static_cast<uint64_t>(i) || b->c[4999] != static_cast<char>(t)) bad[t]++;
        ::operator delete(raw2, std::align_val_t(8192));
        ::operator delete(raw, static_cast<size_t>(100 + i), std::align_val_t(128));
        delete nt;
        delete[] parr;
        delete[] arr;
        delete b;
        delete a;
      }
    });
  }
  for (auto& x : th) x.join();
  for (int t = 0; t < kThreads; t++) CHECK_EQ(bad[t], 0);

  // an impossible size: operator new must throw bad_alloc (malloc gives NULL).
  // Not under valgrind: it replaces operator new and aborts instead of throwing.
  if (under_valgrind()) return;
  bool threw = false;
  try {
    volatile size_t huge = SIZE_MAX / 4;
    char* p = new char[huge];
    p[0] = 1;
    delete[] p;
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  CHECK(threw);
  char* q = new (std::nothrow) char[SIZE_MAX / 4];
  CHECK(q == nullptr);
  delete[] q;
}

TEST(exceptions) {
  std::vector<uint64_t> serial(kThreads), par(kThreads);
  for (int t = 0; t < kThreads; t++) serial[t] = exception_work(t, 500);
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; t++) th.emplace_back([t, &par] { par[t] = exception_work(t, 500); });
  for (auto& x : th) x.join();
  for (int t = 0; t < kThreads; t++) {
    CHECK(serial[t] != 0);
    CHECK(serial[t] == par[t]);
  }
}

TEST(new_delete) {
  std::vector<std::thread> th;
  std::vector<int> bad(kThreads, 0);
  std::vector<uint64_t> sums(kThreads, 0);
  for (int t = 0; t < kThreads; t++) {
    th.emplace_back([t, &bad, &sums] {
      struct Held {
        std::unique_ptr<char[]> p;
        size_t n = 0;
        int i = 0;
      };
      std::vector<Held> keep(256);
      uint64_t s = 0;
      for (int i = 0; i < 20000; i++) {
        Held& h = keep[mix64(static_cast<uint64_t>(t * 1000003 + i)) % keep.size()];
        if (h.p) {
          if (h.p[0] != static_cast<char>(h.n) || h.p[h.n - 1] != static_cast<char>(h.i) ||
              h.p[h.n / 2] != static_cast<char>(t))
            bad[t]++;
          s += h.n;
        }
        size_t n = 3 + mix64(static_cast<uint64_t>(i)) % (i % 100 == 0 ? 300000 : 2000);  // 0 < n/2 < n-1
        h.p.reset(new char[n]);
        h.n = n;
        h.i = i;
        h.p[n / 2] = static_cast<char>(t);
        h.p[0] = static_cast<char>(n);
        h.p[n - 1] = static_cast<char>(i);
        int* one = new int(i);
        s += static_cast<uint64_t>(*one);
        delete one;
      }
      sums[t] = s;
    });
  }
  for (auto& x : th) x.join();
  for (int t = 0; t < kThreads; t++) CHECK_EQ(bad[t], 0);
  for (int t = 1; t < kThreads; t++) CHECK(sums[t] != 0);
}

int main() {
  RUN(containers);
  RUN(exchange);
  RUN(aligned_new);
  RUN(exceptions);
  RUN(new_delete);
  return harness_done_named("test_cxx");
}
