#pragma once

// expect_error(f, needle): runs f and expects a c10::Error whose message
// contains needle (the GoogleTests of the C++ API's errors).

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

template <typename F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
