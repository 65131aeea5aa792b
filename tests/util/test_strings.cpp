// util/strings.h: the whole-number parsers every option and spec parser uses, and the list and
// number formatting helpers.
#include "util/strings.h"

#include <gtest/gtest.h>

namespace kvx {
namespace {

TEST(WholeNumbers, TakeAllOfTheStringOrNothing) {
  EXPECT_EQ(whole_integer("12"), 12);
  EXPECT_EQ(whole_integer("-3"), -3);
  EXPECT_EQ(whole_integer("1099511627776"), int64_t{1} << 40);
  EXPECT_FALSE(whole_integer("12x"));  // "4x" is not 4
  EXPECT_FALSE(whole_integer("1.5"));
  EXPECT_FALSE(whole_integer(""));
  EXPECT_FALSE(whole_integer("x"));
  EXPECT_FALSE(whole_integer("99999999999999999999"));  // past int64
}

TEST(WholeNumbers, IntStaysInsideIntsRange) {
  EXPECT_EQ(whole_int("2147483647"), 2147483647);
  EXPECT_EQ(whole_int("-5"), -5);
  EXPECT_FALSE(whole_int("2147483648"));  // would wrap if cast
  EXPECT_FALSE(whole_int("-2147483649"));
  EXPECT_FALSE(whole_int("7,"));
}

TEST(WholeNumbers, NumbersTakeDecimalsAndExponents) {
  EXPECT_DOUBLE_EQ(*whole_number("0.25"), 0.25);
  EXPECT_DOUBLE_EQ(*whole_number("1e-3"), 1e-3);
  EXPECT_DOUBLE_EQ(*whole_number("4"), 4.0);
  EXPECT_FALSE(whole_number("0.2x"));
  EXPECT_FALSE(whole_number(""));
  EXPECT_FALSE(whole_number("1e999"));  // out of double's range
}

TEST(Strings, ListsDropEmptyItemsAndNumbersPrintAsPeopleWriteThem) {
  EXPECT_EQ(split_list("a,b,,c"), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(split_list("").empty());
  EXPECT_EQ(format_number(0.5), "0.5");
  EXPECT_EQ(format_number(1000), "1000");
  EXPECT_EQ(format_number(3e-4), "0.0003");
}

}  // namespace
}  // namespace kvx
