#!/usr/bin/env python3
"""scripts/check_function_length.py: which braces open functions, where a function starts and
ends, and what the command prints and returns around the limit."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "check_function_length.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_function_length as cfl  # noqa: E402


def functions(src):
    """{name: (first line, last line)} of the functions in src (dedented)."""
    found = cfl.find_functions(textwrap.dedent(src).lstrip("\n"))
    return {name: (first, last) for name, first, last in found}


class FindFunctionsTest(unittest.TestCase):
    def test_braces_in_comments_and_literals_do_not_count(self):
        src = r'''
            int f() {
              // a } in a comment
              /* and { in a block comment } } */
              const char* s = "}{ \" }";
              char c = '}', d = '\'', e = '{';
              const char* raw = R"sql(
                } ) " {{ )sql";
              const char* raw2 = u8R"(})";
              int big = 1'000'000; char brace = '{';
              return 0;
            }
            int g() { return 1; }
            '''
        self.assertEqual(functions(src), {"f": (1, 11), "g": (12, 12)})

    def test_namespaces_and_classes_are_scopes_not_functions(self):
        src = '''
            namespace a {
            namespace {
            struct Point {
              int x = 0;
              int Sum() const { return x; }
              struct Inner {
                void Touch() {
                }
              };
            };
            enum class Kind { kOne, kTwo };
            }  // namespace
            class Box final : public Base<void(int)> {
             public:
              Box(int a, int b) : a_(a), b_{b} {
                a_ += 1;
              }
              ~Box() {}
             private:
              int a_, b_;
            };
            }  // namespace a
            extern "C" {
            int Plain() { return 0; }
            }
            extern "C" int LLVMFuzzerTestOneInput(const char* d, int n) {
              return 0;
            }
            '''
        self.assertEqual(
            functions(src), {
                "Point::Sum": (5, 5),
                "Point::Inner::Touch": (7, 8),
                "Box::Box": (15, 17),
                "Box::~Box": (18, 18),
                "Plain": (24, 24),
                "LLVMFuzzerTestOneInput": (26, 28),
            })

    def test_a_function_starts_at_its_declaration(self):
        src = '''
            template <class T>
            auto Twice(T x)
                -> decltype(x + x) {
              return x + x;
            }
            template <class Op>
            __global__ void __launch_bounds__(256)
                scale_kernel(const Op op, float* x) {
              x[0] = op(x[0]);
            }
            [[nodiscard]] static inline int Three() noexcept(true) { return 3; }
            Result<Format> Format::Parse(std::string_view spec) {
              return Format();
            }
            '''
        self.assertEqual(
            functions(src), {
                "Twice": (1, 5),
                "scale_kernel": (6, 10),
                "Three": (11, 11),
                "Format::Parse": (12, 14),
            })

    def test_lambdas_and_local_classes_belong_to_their_function(self):
        src = '''
            void Outer() {
              auto add = [](int a, int b) {
                return a + b;
              };
              struct Local {
                int Get() { return 1; }
              };
              if (add(1, 2) > 0) {
                for (;;) { break; }
              }
            }
            const auto kSquare = [](int a) {
              return a * a;
            };
            constexpr Entry kTable[] = {
                {"one", [](int a) { return a; }},
                {"two", nullptr},
            };
            std::vector<int> kList{1, 2, 3};
            '''
        self.assertEqual(functions(src), {"Outer": (1, 11), "kSquare": (12, 14)})

    def test_operators(self):
        src = '''
            struct Less {
              bool operator()(int a, int b) const { return a < b; }
              Less& operator=(const Less&) { return *this; }
              bool operator==(const Less&) const { return true; }
              explicit operator bool() const { return true; }
            };
            bool operator<(const Less&, const Less&) {
              return false;
            }
            '''
        self.assertEqual(
            functions(src), {
                "Less::operator()": (2, 2),
                "Less::operator=": (3, 3),
                "Less::operator==": (4, 4),
                "Less::operator bool": (5, 5),
                "operator<": (7, 9),
            })

    def test_only_the_first_branch_of_a_conditional_opens_braces(self):
        src = '''
            #if CPD_WITH_CUDA
            void Launch(int n) {
            #else
            void Launch() {
              int n = 0;
            #endif
              Run(n);
            }
            #define BLOCK(x) do { x; } while (0)
            #ifdef A
            #elif B
            void Stray() {
            #else
            }
            #endif
            int After() { return 0; }
            '''
        self.assertEqual(functions(src), {"Launch": (2, 8), "After": (16, 16)})

    def test_unbalanced_braces_are_an_error(self):
        with self.assertRaises(ValueError):
            cfl.find_functions("void f() {\n")
        with self.assertRaises(ValueError):
            cfl.find_functions("}\n")


class CommandTest(unittest.TestCase):
    def run_on(self, body_lines, *args):
        """Runs the script on a folder holding one function of body_lines + 3 lines."""
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "long.cc")
            with open(path, "w") as f:
                f.write("// header\n" + "int Long(int x) {\n" + "  x += 1;\n" * body_lines +
                        "  return x;\n}\n")
            r = subprocess.run([sys.executable, SCRIPT, *args, d], capture_output=True,
                               text=True)
            return r, path

    def test_a_function_over_the_limit_is_named_and_fails(self):
        r, path = self.run_on(148)  # 151 lines with its signature, return and closing brace
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stdout, f"{path}:2: function Long is 151 lines (limit 150)\n")

    def test_a_function_at_the_limit_passes_with_one_summary_line(self):
        r, path = self.run_on(147)  # 150 lines
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(
            r.stdout, "check_function_length: 1 functions in 1 files, none over 150 lines "
            f"(longest: Long, 150 lines, {path}:2)\n")

    def test_the_limit_is_an_option(self):
        r, path = self.run_on(10, "--limit", "12")
        self.assertEqual(r.returncode, 1)
        self.assertEqual(r.stdout, f"{path}:2: function Long is 13 lines (limit 12)\n")

    def test_unbalanced_braces_fail_the_check(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "bad.h"), "w") as f:
                f.write("void f() {\n")
            r = subprocess.run([sys.executable, SCRIPT, d], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("cannot match the braces", r.stderr)


if __name__ == "__main__":
    unittest.main()
