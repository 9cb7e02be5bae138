#include <gtest/gtest.h>
#include "data/chat_template.h"
TEST(JinjaTemplate, Placeholder) {}
