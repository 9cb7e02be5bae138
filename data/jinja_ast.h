// The syntax tree of a parsed Jinja template (jinja_parser.h builds it, jinja_interpreter.h
// walks it). Immutable after parsing; string constants are views into the nodes' own storage.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/jinja_value.h"

namespace strata::data::jinja {

enum class ExprKind : uint8_t {
  kConst,    // value
  kName,     // name
  kList,     // args: items
  kTuple,    // args: items
  kDict,     // args: key, value, key, value, ...
  kAttr,     // args[0].name
  kItem,     // args[0][args[1]]
  kSlice,    // args[0][args[1]:args[2]:args[3]] (each of 1..3 may be null)
  kCall,     // args[0](args[1:], kwargs)
  kFilter,   // args[0] | name(args[1:], kwargs); args[0] null in a filter block's chain
  kTest,     // args[0] is [not] name(args[1:], kwargs)
  kNeg,      // -args[0]
  kPos,      // +args[0]
  kNot,      // not args[0]
  kBinary,   // args[0] op args[1]
  kConcat,   // args[0] ~ args[1]
  kCompare,  // args[0] cmp_ops[0] args[1] cmp_ops[1] args[2] ...
  kAnd,
  kOr,
  kCond,  // args[1] if args[0] else args[2] (args[2] may be null)
};

enum class BinOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CmpOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  ExprKind kind = ExprKind::kConst;
  int line = 0;
  BinOp op = BinOp::kAdd;
  bool negated = false;  // kTest: `is not`
  Value value;           // kConst
  std::string name;
  std::string literal;  // kConst string bytes (value views them)
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::vector<CmpOp> cmp_ops;
};

enum class StmtKind : uint8_t {
  kText,      // text
  kOutput,    // {{ expr }}
  kIf,        // if expr: body else else_body (elif is a nested kIf in else_body)
  kFor,       // for targets in expr [if cond]: body else else_body
  kSet,       // set targets = expr | set targets[0].attr = expr
  kSetBlock,  // set targets[0] [| filters] %} body {% endset
  kMacro,     // macro name(params, defaults) body
  kBreak,
  kContinue,
  kGeneration,   // generation %} body {% endgeneration
  kFilterBlock,  // filter filters %} body {% endfilter
};

struct Stmt {
  StmtKind kind = StmtKind::kText;
  int line = 0;
  std::string text;  // kText; kMacro: the macro's name; kSet: the attribute of `ns.attr`
  std::unique_ptr<Expr> expr;
  std::unique_ptr<Expr> cond;
  std::vector<std::string> targets;
  bool tuple_target = false;
  std::vector<std::unique_ptr<Stmt>> body;
  std::vector<std::unique_ptr<Stmt>> else_body;
  std::vector<std::string> params;              // kMacro
  std::vector<std::unique_ptr<Expr>> defaults;  // kMacro, aligned with params (null: none)
  std::vector<std::unique_ptr<Expr>> filters;   // kSetBlock, kFilterBlock: kFilter nodes
};

using StmtList = std::vector<std::unique_ptr<Stmt>>;

}  // namespace strata::data::jinja
